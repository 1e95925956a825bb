"""The AdaPLD config and proposer end to end (no model); its retrieval
pieces are tested in tests/sources/test_retrieval.py."""

import gc
import tracemalloc

import numpy as np
import pytest
import torch

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.methods.adapld import AdaPLDConfig, AdaPLDProposer
from tests.methods.budget import propose, tree_paths
from tests.helpers.retrieval import H, V, embeddings, unit
from tests.helpers.retrieval_steps import make_ctx, step


# ---------------------------------------------------------------- the config


def test_config_validation():
    cfg = AdaPLDConfig()
    assert cfg.topk == cfg.branch_width == 4 and cfg.branch_nodes == 12
    paper = AdaPLDConfig(paper_literal=True)
    assert paper.branch_nodes == 8 and paper.succ_len == 1
    for n in (1, 2, 8, 9, 16):  # the defaults start at any budget
        cfg.check_against(n)
        paper.check_against(n)
        assert cfg.copy_cap(n) == n
    assert [paper.copy_cap(n) for n in (1, 8, 9, 16)] == [1, 1, 1, 8]
    with pytest.raises(SpecplugConfigError, match=r"\['max_copy_len'\]") as e:
        AdaPLDConfig(max_copy_len=20).check_against(16)
    assert "\n" not in str(e.value)
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

def Paper(**kw):
    """The paper-literal construction (what these proposer tests pin down);
    the scored default is tested below them."""
    return AdaPLDConfig(paper_literal=True, **kw)



def topk_rows(rows_ids):
    ids = torch.tensor(rows_ids)
    probs = torch.linspace(0.5, 0.1, ids.shape[1]).repeat(ids.shape[0], 1)
    return ids, probs


def test_proposer_lexical_hit_main_branches_successors():
    cfg = Paper(branch_width=3, max_copy_len=4)
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
    cfg = Paper(branch_width=2, similarity_threshold=0.5)
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
    p = AdaPLDProposer(Paper(similarity_threshold=0.5), make_ctx(16, embed=emb))
    assert propose(p, [step([3, 7, 4, 8, 1])]) == [None]
    s = p.report()
    assert (s["no_hits"], s["fallback_fires"], s["no_hit_rate"]) == (1, 1, 1.0)
    q = AdaPLDProposer(Paper(semantic_fallback=False), make_ctx(16))
    assert propose(q, [step([3, 7, 4, 8, 1])]) == [None]
    assert q.report()["fallback_fires"] == 0


def test_proposer_feedback_counts_main_and_mismatch():
    p = AdaPLDProposer(Paper(branch_width=0, max_copy_len=4), make_ctx(8))
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
    p = AdaPLDProposer(Paper(branch_width=4, successor_drafting=False), ctx)
    tree = propose(p, [step(tokens, topk=topk_rows(ids))])[0]
    assert len(tree) == 10 and tree.tokens[:6] == [2, 3, 4, 5, 6, 7]
    ctx = make_ctx(10, max_len=len(tokens) + 4)  # 3 drafts + the bonus token
    p = AdaPLDProposer(Paper(branch_width=4, successor_drafting=False), ctx)
    assert len(propose(p, [step(tokens, topk=topk_rows(ids))])[0]) == 3
    p = AdaPLDProposer(Paper(branch_width=4), make_ctx(16))
    tree = propose(p, [step(tokens, topk=topk_rows(ids), chain_only=True)])[0]
    assert tree.is_chain() and tree.tokens[:3] == [2, 3, 4] and len(tree) == 8


def test_proposer_unsampled_chunk_builds_memory_only():
    p = AdaPLDProposer(Paper(branch_width=0, max_copy_len=3), make_ctx(8))
    toks = np.array([5, 1, 2, 3, 4, 1, 9, 9])
    first = StepRequest("r", toks[:4], 8, False, 0, layer_hidden=torch.ones(4, H))
    assert propose(p, [first]) == [None]
    assert p.report()["retrieval_attempts"] == 0
    second = step(toks[:7].tolist() + [1], verified_pos=4)
    assert propose(p, [second])[0].tokens == [2, 3, 4]


def test_memory_freed_after_200_add_remove_cycles():
    p = AdaPLDProposer(Paper(branch_width=2), make_ctx(8))
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


def test_semantic_fallback_finds_tokens_generated_later():
    emb = embeddings(similar=[(1, 7, 0.9)])
    p = AdaPLDProposer(Paper(branch_width=2, similarity_threshold=0.5),
                       make_ctx(8, embed=emb))
    assert propose(p, [step([3, 4, 5, 6])]) == [None]  # nothing similar yet
    tokens = [3, 4, 5, 6, 7, 9, 1]  # 7 arrives, then the query 1
    tree = propose(p, [step(tokens, verified_pos=3,
                           topk=topk_rows([[0, 0], [30, 31], [0, 0]]))])[0]
    assert sorted(tree.tokens) == [30, 31]
    assert p.report()["semantic_hits"] == 1


# ------------------------------------------------------------ the scored default


def probs_rows(rows_ids, rows_probs):
    return torch.tensor(rows_ids), torch.tensor(rows_probs, dtype=torch.float32)


def test_scored_confident_copy_takes_the_whole_budget():
    """A 4-token suffix match whose anchor predicted the copy: the main path
    is pld's chain at full length; no branch is worth a node."""
    p = AdaPLDProposer(AdaPLDConfig(), make_ctx(8))
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 30, 1, 2, 3, 4, 1]
    tokens = tokens[:-1]  # ends with ... 1 2 3 4: matches positions 0-3
    ids = [[0, 40, 41, 42]] * (len(tokens) - 1)
    ids[3] = [5, 40, 41, 42]  # the anchor (pos 3) predicted the copy's 5
    prob = [[0.9, 0.05, 0.03, 0.02]] * (len(tokens) - 1)
    tree = propose(p, [step(tokens, topk=probs_rows(ids, prob))])[0]
    from vllm_specplug.sources.ngram import continuations
    pld = continuations(np.array(tokens), 1, 4, 8, 1)[0].tolist()
    assert tree.is_chain() and tree.tokens == pld == [5, 6, 7, 8, 9, 10, 11, 12]
    assert tree.scores is not None and len(tree.scores) == len(tree)
    assert all(a > b for a, b in zip(tree.scores, tree.scores[1:]))
    assert p.report()["suffix_anchors"] == 1


def test_scored_uncertain_copy_shares_the_budget_with_branches():
    """A one-token match whose anchor was unsure: branches outrank the deep
    copy nodes, which are cut; every node carries a score."""
    p = AdaPLDProposer(AdaPLDConfig(successor_drafting=False), make_ctx(8))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]
    ids = [[0, 0, 0, 0]] * 11
    ids[0] = [2, 40, 41, 42]  # after the anchor (pos 0)
    prob = [[0.25, 0.25, 0.25, 0.25]] * 11
    tree = propose(p, [step(tokens, topk=probs_rows(ids, prob))])[0]
    main = tree.first_path().tokens
    assert main[0] == 2 and 1 < len(main) < 8  # copy kept, but not to the end
    roots = {t for t, q in zip(tree.tokens, tree.parents) if q < 0}
    assert roots == {2, 40, 41, 42} and len(tree) == 8
    assert tree.scores is not None and len(tree.scores) == 8


def test_scored_longest_match_beats_single_token_rerank():
    """The query 1 occurs at 2 (after 7 8, as the context ends) and at 6;
    the hidden state before 6 equals the query's, so the paper's rerank
    picks 6, while the longest suffix match copies after 2."""
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [7, 8, 1, 2, 3, 9, 1, 4, 5, 6, 7, 8, 1]
    hidden = torch.stack([torch.from_numpy(unit(i)) for i in range(12)])
    hidden[5] = hidden[11]
    scored = AdaPLDProposer(AdaPLDConfig(branch_width=0), make_ctx(4))
    paper = AdaPLDProposer(AdaPLDConfig(branch_width=0, paper_literal=True), make_ctx(4))
    t1 = propose(scored, [step(tokens, hidden=hidden)])[0]
    t2 = propose(paper, [step(tokens, hidden=hidden)])[0]
    assert t1.tokens == [2, 3, 9, 1]  # after the 3-token match at 0..2
    assert t2.tokens == [4, 5, 6, 7]  # the reranked single-token anchor at 6


def test_scored_single_token_match_falls_back_to_rerank():
    """Nothing longer than the query token matches: the paper's rerank
    chooses the anchor (its hidden state points at position 6)."""
    tokens = [5, 1, 2, 3, 9, 8, 1, 4, 6, 1]
    hidden = torch.stack([torch.from_numpy(unit(i)) for i in range(9)])
    hidden[5] = hidden[8]
    p = AdaPLDProposer(AdaPLDConfig(branch_width=0), make_ctx(3))
    assert propose(p, [step(tokens, hidden=hidden)])[0].tokens == [4, 6, 1]
    assert p.report()["rerank_anchors"] == 1
    q = AdaPLDProposer(AdaPLDConfig(branch_width=0, rerank_single=False), make_ctx(3))
    assert propose(q, [step(tokens, hidden=hidden)])[0].tokens == [2, 3, 9]  # pld's pick


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_scored_any_budget(budget):
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    ids = [[3, 40, 41, 42]] * 9
    for paper in (False, True):
        p = AdaPLDProposer(AdaPLDConfig(paper_literal=paper), make_ctx(budget))
        tree = propose(p, [step(tokens, topk=topk_rows(ids))])[0]
        tree.validate()
        assert 1 <= len(tree) <= budget and tree.tokens[0] == 3


def test_scored_feedback_moves_the_copy_estimate():
    """Accepted copies raise the estimate for their match length; the
    branch calibration falls when branches keep missing."""
    p = AdaPLDProposer(AdaPLDConfig(branch_width=2, successor_drafting=False), make_ctx(4))
    base = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    ids = [[4, 40, 41]] * 10
    before = p.copy.first[2].value, p.copy.next[2].value
    tree = propose(p, [step(base, topk=topk_rows(ids))])[0]
    assert tree.tokens[:3] == [4, 5, 6]
    nxt = base + [4, 5, 6, 7, 60]  # 4 accepted (the whole kept copy) + bonus
    req = step(nxt, verified_pos=10, topk=topk_rows([[0, 0, 0]] * 5))
    req.draft_kept = len(tree)
    propose(p, [req])
    after = p.copy.first[2].value, p.copy.next[2].value
    assert after[0] > before[0] and after[1] > before[1]
