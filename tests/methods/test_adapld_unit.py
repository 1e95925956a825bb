"""AdaPLD steps on hand-made memories, and the proposer end to end (no model)."""

import gc
import tracemalloc

import numpy as np
import pytest
import torch

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.methods.adapld import AdaPLDConfig, AdaPLDProposer
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
from vllm_specplug.sources.context_memory import ContextMemory
from tests.methods.budget import propose, tree_paths

V, H = 64, 4


def unit(i, dim=H):
    v = np.zeros(dim, dtype=np.float32)
    v[i % dim] = 1.0
    return v


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


def embeddings(similar=()):
    """One-hot token embeddings; ``similar`` pairs (a, b, cos) get cosine cos."""
    e = torch.eye(V)
    for a, b, c in similar:
        e[b] = c * e[a] + (1 - c * c) ** 0.5 * torch.eye(V)[b]
    return e


def make_ctx(n_spec=8, embed=None, layers=4, max_len=4096):
    return ProposerContext(
        vocab_size=V, hidden_size=H, num_speculative_tokens=n_spec,
        max_model_len=max_len, device=torch.device("cpu"), dtype=torch.float32,
        model_path="", tokenizer_path="",
        embed_tokens=embeddings() if embed is None else embed,
        num_hidden_layers=layers,
    )


def step(tokens, verified_pos=0, hidden=None, topk=None, req_id="r", chain_only=False,
         sampled=True):
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = len(tokens) - 1 - verified_pos
    if hidden is None:
        hidden = torch.stack([torch.from_numpy(unit(p)) for p in range(verified_pos, verified_pos + rows)])
    ids = probs = None
    if topk is not None:
        ids, probs = topk
    return StepRequest(req_id=req_id, token_ids=tokens, num_prompt_tokens=len(tokens) - 1,
                       sampled=sampled, verified_pos=verified_pos, layer_hidden=hidden,
                       topk_ids=ids, topk_probs=probs, chain_only=chain_only)


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


# ---------------------------------------------------------------- the config


def test_config_validation():
    cfg = AdaPLDConfig()
    assert cfg.topk == cfg.branch_width == 4 and cfg.branch_nodes == 8
    cfg.check_against(9)
    with pytest.raises(SpecplugConfigError, match=r"\['branch_width'\]") as e:
        cfg.check_against(8)
    assert "\n" not in str(e.value)
    with pytest.raises(SpecplugConfigError, match=r"\['max_copy_len'\]"):
        AdaPLDConfig(max_copy_len=20).check_against(16)
    with pytest.raises(SpecplugConfigError, match=r"\['memory_head_positions'\]"):
        AdaPLDConfig(memory_max_positions=100, memory_head_positions=60).check_against(16)
    small = AdaPLDConfig(memory_max_positions=100)  # the default head follows the cap
    small.check_against(16)
    assert small.head_positions == 12 and AdaPLDConfig().head_positions == 1024
    AdaPLDConfig(branch_width=0).check_against(1)
    AdaPLDConfig(successor_drafting=False).check_against(5)
    for bad in ({"similarity_threshold": 1.0}, {"branch_width": -1}, {"bogus": 1},
                {"hidden_layer": -1}, {"successor_drafting": "yes"}):
        with pytest.raises(ValueError):
            AdaPLDConfig(**bad)


def test_layer_checked_against_model():
    with pytest.raises(ValueError, match=r"\['hidden_layer'\]=4 is out of range") as e:
        AdaPLDProposer(AdaPLDConfig(hidden_layer=4), make_ctx(16, layers=4))
    assert "\n" not in str(e.value)
    p = AdaPLDProposer(AdaPLDConfig(hidden_layer=3), make_ctx(16, layers=4))
    assert p.needs().hidden_layer == 3
    p = AdaPLDProposer(AdaPLDConfig(), make_ctx(16, layers=30))
    needs = p.needs()
    assert (needs.hidden_layer, needs.topk, needs.prefill_topk) == (10, 4, True)
    with pytest.raises(ValueError, match="semantic_fallback"):
        AdaPLDProposer(AdaPLDConfig(), ProposerContext(
            V, H, 16, 100, torch.device("cpu"), torch.float32, "", "", None, 4))


# --------------------------------------------------------------- the proposer


def topk_rows(rows_ids):
    ids = torch.tensor(rows_ids)
    probs = torch.linspace(0.5, 0.1, ids.shape[1]).repeat(ids.shape[0], 1)
    return ids, probs


def test_proposer_lexical_hit_main_branches_successors():
    cfg = AdaPLDConfig(branch_width=3, max_copy_len=4)
    p = AdaPLDProposer(cfg, make_ctx(12))
    #         0  1  2  3  4  5   6  7  8
    tokens = [5, 1, 2, 3, 4, 20, 6, 21, 1]
    ids = [[0, 0, 0]] * 8
    ids[1] = [2, 20, 21]  # after the anchor (pos 1): main first (2) + branches 20, 21
    tree = propose(p, [step(tokens, topk=topk_rows(ids))])[0]
    tree.validate()
    assert tree.tokens[:4] == [2, 3, 4, 20]  # copy after the anchor
    # branches 20 -> successor 6 (pos 5 -> 6), 21 -> successor 1 (pos 7 -> 8)
    paths = set(tree_paths(tree))
    assert {(20,), (20, 6), (21,), (21, 1)} <= paths
    s = p.report()
    assert s["lexical_hits"] == 1 and s["drafts_lexical"] == 1 and s["lexical_hit_rate"] == 1
    assert s["successor_lexical"] == 2


def test_proposer_semantic_fallback_draft_and_stats():
    emb = embeddings(similar=[(1, 7, 0.9)])
    cfg = AdaPLDConfig(branch_width=2, similarity_threshold=0.5)
    p = AdaPLDProposer(cfg, make_ctx(8, embed=emb))
    tokens = [3, 7, 4, 8, 1]  # query 1 is new; 7 is its embedding neighbour
    ids = [[0, 0], [40, 41], [0, 0], [0, 0]]
    tree = propose(p, [step(tokens, topk=topk_rows(ids))])[0]
    # no main copy from a semantic anchor: the branches are the anchor's top-k
    assert sorted(tree.tokens) == [40, 41] and all(q == -1 for q in tree.parents)
    s = p.report()
    assert (s["fallback_fires"], s["semantic_hits"], s["drafts_semantic"]) == (1, 1, 1)
    assert s["semantic_recovery"] == 1.0
    # the target accepted 41 then sampled 9: the fallback draft recovered
    nxt = tokens + [41, 9]
    propose(p, [step(nxt, verified_pos=4, topk=topk_rows([[0, 0]] * 2))])
    s = p.report()
    assert s["verified_semantic"] == 1 and s["accepted_any_semantic"] == 1
    assert s["fallback_recovery_rate"] == 1.0 and s["accepted_branch"] == 1


def test_proposer_no_hit_and_threshold():
    emb = embeddings(similar=[(1, 7, 0.2)])
    p = AdaPLDProposer(AdaPLDConfig(similarity_threshold=0.5), make_ctx(16, embed=emb))
    assert propose(p, [step([3, 7, 4, 8, 1])]) == [None]
    s = p.report()
    assert (s["no_hits"], s["fallback_fires"], s["no_hit_rate"]) == (1, 1, 1.0)
    q = AdaPLDProposer(AdaPLDConfig(semantic_fallback=False), make_ctx(16))
    assert propose(q, [step([3, 7, 4, 8, 1])]) == [None]
    assert q.report()["fallback_fires"] == 0


def test_proposer_feedback_counts_main_and_mismatch():
    p = AdaPLDProposer(AdaPLDConfig(branch_width=0, max_copy_len=4), make_ctx(8))
    tokens = [5, 1, 2, 3, 4, 9, 1]
    tree = propose(p, [step(tokens)])[0]
    assert tree.tokens == [2, 3, 4, 9]
    propose(p, [step(tokens + [2, 3, 7], verified_pos=6)])  # 2 accepted, then 7
    s = p.report()
    assert s["accepted_tokens_lexical"] == 2 and s["accepted_main"] == 1
    propose(p, [step(tokens + [2, 3, 7, 8], verified_pos=9)])  # draft after 7: none
    assert p.report()["mismatch"] == 0  # no draft was pending (7 never occurred)
    propose(p, [step(tokens + [2, 3, 7, 8, 2, 5], verified_pos=10)])
    propose(p, [step(tokens + [2, 3, 7, 8, 2, 5, 6], verified_pos=12)])
    assert p.report()["mismatch"] == 1


def test_proposer_respects_budget_max_model_len_and_chain_only():
    tokens = list(range(1, 40)) + [1]
    ids = [[40 + i % 5, 50, 51, 52] for i in range(39)]
    ctx = make_ctx(10)
    p = AdaPLDProposer(AdaPLDConfig(branch_width=4, successor_drafting=False), ctx)
    tree = propose(p, [step(tokens, topk=topk_rows(ids))])[0]
    assert len(tree) == 10 and tree.tokens[:6] == [2, 3, 4, 5, 6, 7]
    ctx = make_ctx(10, max_len=len(tokens) + 4)  # 3 drafts + the bonus token
    p = AdaPLDProposer(AdaPLDConfig(branch_width=4, successor_drafting=False), ctx)
    assert len(propose(p, [step(tokens, topk=topk_rows(ids))])[0]) == 3
    p = AdaPLDProposer(AdaPLDConfig(branch_width=4), make_ctx(16))
    tree = propose(p, [step(tokens, topk=topk_rows(ids), chain_only=True)])[0]
    assert tree.is_chain() and tree.tokens[:3] == [2, 3, 4] and len(tree) == 8


def test_proposer_unsampled_chunk_builds_memory_only():
    p = AdaPLDProposer(AdaPLDConfig(branch_width=0, max_copy_len=3), make_ctx(8))
    toks = np.array([5, 1, 2, 3, 4, 1, 9, 9])
    first = StepRequest("r", toks[:4], 8, False, 0, layer_hidden=torch.ones(4, H))
    assert propose(p, [first]) == [None]
    assert p.report()["retrieval_attempts"] == 0
    second = step(toks[:7].tolist() + [1], verified_pos=4)
    assert propose(p, [second])[0].tokens == [2, 3, 4]


def test_memory_freed_after_200_add_remove_cycles():
    p = AdaPLDProposer(AdaPLDConfig(branch_width=2), make_ctx(8))
    rng = np.random.default_rng(0)
    tokens = np.append(rng.integers(0, V - 1, 256), V - 1)  # new query: fallback runs
    hidden = torch.randn(256, H)
    topk = topk_rows(rng.integers(0, V, (256, 2)).tolist())

    def cycle(i):
        rid = f"q{i}"
        p.add_request(rid)
        propose(p, [step(tokens, hidden=hidden, topk=topk, req_id=rid)])
        assert rid in p.memories and len(p._vocabs[rid]) > 0
        p.remove_request(rid)

    for i in range(3):
        cycle(i)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(200):
            cycle(i)
        gc.collect()
        now, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(p.memories) == 0 and not p._pending and not p._vocabs
    assert p.report()["fallback_fires"] == 203
    assert now - base < 64 * 1024


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


def test_semantic_fallback_finds_tokens_generated_later():
    emb = embeddings(similar=[(1, 7, 0.9)])
    p = AdaPLDProposer(AdaPLDConfig(branch_width=2, similarity_threshold=0.5),
                       make_ctx(8, embed=emb))
    assert propose(p, [step([3, 4, 5, 6])]) == [None]  # nothing similar yet
    tokens = [3, 4, 5, 6, 7, 9, 1]  # 7 arrives, then the query 1
    tree = propose(p, [step(tokens, verified_pos=3,
                           topk=topk_rows([[0, 0], [30, 31], [0, 0]]))])[0]
    assert sorted(tree.tokens) == [30, 31]
    assert p.report()["semantic_hits"] == 1
