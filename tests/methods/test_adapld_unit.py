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
from tests.sources.test_retrieval import H, V, embeddings, unit


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
