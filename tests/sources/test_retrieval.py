"""sources/retrieval.py on hand-made memories: candidates, reranking,
branches, successors, tree building, the per-request token table."""

import numpy as np
import torch

from tests.helpers.retrieval import H, V, embeddings, unit
from vllm_specplug.sources.context_memory import ContextMemory
from vllm_specplug.sources.retrieval import (
    BRANCH,
    LEXICAL,
    MAIN,
    SEMANTIC,
    SUCCESSOR,
    EmbeddingSimilarity,
    TokenVocab,
    branch_tokens,
    build_draft_tree,
    lexical_candidates,
    node_kinds,
    rerank,
    semantic_candidates,
    successor_paths,
)

def make_mem(tokens, hidden=None, topk=None, k=4, cap=4096, head=0):
    """A memory holding ``tokens``; ``hidden``/``topk`` map position -> row
    (positions left out have no state, like the last token)."""
    mem = ContextMemory(H, k, max_positions=cap, head_positions=head)
    tokens = np.asarray(tokens)
    mem.update(tokens, 0)
    for p, h in (hidden or {}).items():
        mem.update(tokens, p, np.asarray(h, dtype=np.float32)[None])
    for p, ids in (topk or {}).items():
        probs = np.linspace(0.5, 0.1, len(ids))[None]
        mem.update(tokens, p, topk_ids=np.asarray(ids)[None], topk_probs=probs)
    return mem


# ------------------------------------------------------------------ retrieval


def test_lexical_hit_candidates_most_recent_first():
    mem = make_mem([1, 5, 2, 5, 3, 7, 5])
    assert list(lexical_candidates(mem, 5, mem.n - 1, 10)) == [3, 1]
    assert list(lexical_candidates(mem, 5, mem.n - 1, 1)) == [3]
    assert len(lexical_candidates(mem, 9, mem.n - 1, 10)) == 0


def test_lexical_ngram_prefers_longer_suffix():
    #        0  1  2  3  4  5  6  7  8
    mem = make_mem([4, 5, 9, 6, 5, 9, 8, 6, 5])
    q = mem.n - 1
    assert list(lexical_candidates(mem, 5, q, 10, ngram=1, query_slot=q)) == [4, 1]
    assert list(lexical_candidates(mem, 5, q, 10, ngram=3, query_slot=q)) == [4]


def test_lexical_miss_semantic_hit():
    emb = embeddings(similar=[(1, 7, 0.9), (1, 8, 0.2)])
    sim = EmbeddingSimilarity(emb)
    mem = make_mem([3, 7, 4, 8, 5, 7, 2, 1])  # query 1 never occurred before
    q = mem.n - 1
    assert len(lexical_candidates(mem, 1, q, 10)) == 0
    cands = semantic_candidates(mem, np.array([1]), q, sim, 0.5, 10)[0]
    assert list(cands) == [5, 1]  # both 7s (cos .9), most recent first; 8 (cos .2) not
    assert list(semantic_candidates(mem, np.array([1]), q, sim, 0.1, 10)[0]) == [5, 1, 3]
    assert len(semantic_candidates(mem, np.array([1]), q, sim, 0.95, 10)[0]) == 0


def test_embedding_similarity_cosine():
    emb = torch.randn(V, 16)
    sim = EmbeddingSimilarity(emb)
    got = sim.cosine(np.array([3, 4]), np.array([4]))
    want = torch.nn.functional.cosine_similarity(emb[[3, 4]], emb[4][None], dim=1)
    np.testing.assert_allclose(got[:, 0], want.numpy(), rtol=1e-5)


def test_rerank_order_by_prefix_state():
    q = unit(0)
    cos_to_q = {0: 0.1, 2: 0.9, 4: 0.5}  # prefix position -> cos with query state
    hidden = {p: c * unit(0) + (1 - c * c) ** 0.5 * unit(1) for p, c in cos_to_q.items()}
    #               0  1  2  3  4  5  6
    mem = make_mem([0, 5, 0, 5, 0, 5, 5], hidden=hidden)
    cands = lexical_candidates(mem, 5, 6, 10)
    assert list(cands) == [5, 3, 1]
    ranked, scores = rerank(mem, cands, q)
    assert list(ranked) == [3, 5, 1]
    np.testing.assert_allclose(scores, [0.9, 0.5, 0.1], atol=2e-3)


def test_rerank_missing_state_last_and_ties_keep_recency():
    mem = make_mem([5, 5, 5, 5, 5], hidden={1: unit(0), 2: unit(0)})
    ranked, scores = rerank(mem, np.array([3, 2, 1, 0]), unit(0))
    assert list(ranked) == [3, 2, 1, 0]  # 3, 2 tie (both 1.0); 1, 0 have no prefix state
    assert list(scores[2:]) == [-2, -2]
    ranked, _ = rerank(mem, np.array([3, 2, 1]), None)  # no query state: keep order
    assert list(ranked) == [3, 2, 1]


# -------------------------------------------------------------- construction


def test_branch_dedup_removes_main_first_invalid_and_repeats():
    mem = make_mem([1, 2, 3], topk={0: [2, 9, 9, -1, 70, 11]}, k=6)
    assert branch_tokens(mem, 0, 6, exclude=2, vocab_size=V) == [9, 11]
    assert branch_tokens(mem, 0, 2, exclude=2, vocab_size=V) == [9]  # top-k, then removal
    assert branch_tokens(mem, 0, 6, exclude=-1, vocab_size=V) == [2, 9, 11]
    assert branch_tokens(mem, 1, 6) == []  # no stored top-k


def test_branch_min_prob_and_probability_order():
    mem = ContextMemory(H, 3, max_positions=16)
    mem.update(np.array([1, 2]), 0, topk_ids=np.array([[4, 5, 6]]),
               topk_probs=np.array([[0.1, 0.6, 0.3]]))
    assert branch_tokens(mem, 0, 3) == [5, 6, 4]
    assert branch_tokens(mem, 0, 3, min_prob=0.2) == [5, 6]


def test_successor_extension_lexical_reranked_by_anchor_state():
    # anchor at 0 with state unit(2); branch token 9 occurs at 3 and 6; the
    # state before 6 (pos 5) matches the anchor's, the one before 3 does not.
    #               0  1  2  3  4  5  6   7  8
    mem = make_mem([1, 2, 0, 9, 4, 0, 9, 11, 1],
                   hidden={0: unit(2), 2: unit(1), 5: unit(2)})
    conts, srcs = successor_paths(mem, [9, 30], anchor=0, length=1, max_candidates=8)
    assert [list(c) for c in conts] == [[11], []]
    assert srcs == [LEXICAL, None]
    conts, _ = successor_paths(mem, [9], anchor=0, length=2, max_candidates=8)
    assert list(conts[0]) == [11, 1]
    # the last position has no following token: never a successor
    conts, _ = successor_paths(mem, [1], anchor=0, length=1, max_candidates=8)
    assert list(conts[0]) == [2]


def test_successor_semantic_fallback():
    sim = EmbeddingSimilarity(embeddings(similar=[(30, 9, 0.8)]))
    mem = make_mem([1, 2, 0, 9, 4, 1])
    conts, srcs = successor_paths(mem, [30], 0, 1, 8, sim=sim, threshold=0.5)
    assert [list(c) for c in conts] == [[4]] and srcs == [SEMANTIC]


def test_build_tree_layout_and_kinds():
    tree = build_draft_tree([2, 3, 4], [9, 11], [[12], []], room=8)
    tree.validate()
    assert tree.tokens == [2, 3, 4, 9, 12, 11]
    assert tree.parents == [-1, 0, 1, -1, 3, -1]
    assert node_kinds(tree, 2) == [MAIN, MAIN, MAIN, BRANCH, SUCCESSOR, BRANCH]


def test_budget_respected():
    main = list(range(1, 40))
    branches = list(range(40, 50))
    succs = [[b + 10] for b in branches]
    for room in range(1, 30):
        tree = build_draft_tree(main, branches, succs, room)
        tree.validate()
        assert len(tree) == room
        assert tree.tokens[0] == 1  # main path first, never crowded out
    tree = build_draft_tree(main, branches[:2], succs[:2], room=10)
    # main gets what the branches leave: 10 - 2 * 2
    assert tree.tokens == [1, 2, 3, 4, 5, 6, 40, 50, 41, 51]
    tree = build_draft_tree(main, branches, succs, room=14)
    assert sum(p == -1 for p in tree.parents) == 11  # every branch before any successor
    assert build_draft_tree([], [], [], room=8) is None
    assert build_draft_tree(main, branches, succs, room=0) is None


def test_chain_only():
    tree = build_draft_tree([2, 3, 4], [9], [[12]], room=8, chain_only=True)
    assert tree.is_chain() and tree.tokens == [2, 3, 4]
    tree = build_draft_tree([], [9, 10], [[12], [13]], room=8, chain_only=True)
    assert tree.is_chain() and tree.tokens == [9, 12]
    assert len(build_draft_tree(list(range(20)), [], [], room=5, chain_only=True)) == 5


# ------------------------------------------------------------- token table


def brute_semantic(mem, q, limit, emb, threshold):
    e = torch.nn.functional.normalize(emb, dim=1)
    toks = mem.tokens[:limit]
    cos = (e[torch.from_numpy(toks.astype(np.int64))] @ e[q]).numpy()
    return {int(s) for s in np.flatnonzero((cos > threshold) & (toks != q))}


def test_token_vocab_incremental_matches_brute_force_through_eviction():
    emb = torch.randn(V, 16, generator=torch.Generator().manual_seed(1))
    sim = EmbeddingSimilarity(emb)
    vocab = TokenVocab(sim)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, V, 400)
    mem = ContextMemory(H, 0, max_positions=64, head_positions=8)
    for end in range(2, 400, 7):
        mem.update(tokens[:end], 0)
        q = int(tokens[end - 1])
        got = semantic_candidates(mem, np.array([q]), mem.n - 1, sim, 0.3, 10_000,
                                  vocab=vocab)[0]
        assert set(got.tolist()) == brute_semantic(mem, q, mem.n - 1, emb, 0.3)
        assert len(vocab) <= 2 * mem.n + 256
    assert mem.evicted
    # a reset memory (history rewritten) rebuilds the table
    mem.update(np.array([5, 6, 7, 5]), 0)
    got = semantic_candidates(mem, np.array([9]), 3, sim, -1.0, 10, vocab=vocab)[0]
    assert sorted(got.tolist()) == [0, 1, 2] and sorted(vocab.tokens.tolist()) == [5, 6, 7]
