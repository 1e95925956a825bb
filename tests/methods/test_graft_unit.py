"""`graft` without an engine: the checkpoint rule, the stage splits of the
merged tree, the ablations and the start-up errors (shipped head, a random
stand-in for the target's embeddings, a filled adjacency table)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from tests.methods.budget import propose
from tests.helpers.contexts import proposer_ctx

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.methods.graft import GraftConfig, GraftProposer, _Gate
from vllm_specplug.registry import resolve

VOCAB, HIDDEN = 49152, 576


def test_checkpoint_fires_exactly_at_its_threshold():
    cfg = GraftConfig(checkpoints=[0, 1, 5], thresholds=[0.25, 0.5, 0.75])
    gate = _Gate(cfg, 3, stop=True)
    # runtime depth 1 = the root step's candidates = checkpoint d0
    at = torch.tensor([[math.log(0.25), -9.0],            # c = tau: pruned (Eq. 7: c > tau keeps)
                       [math.log(0.2500001), -9.0],       # just above: kept
                       [math.log(0.9), math.log(0.1)]])
    keep = gate(1, at)
    assert keep.tolist() == [False, True, True] and gate.stage == [0, None, None]
    assert gate(3, torch.zeros(3, 2)) is None  # not a checkpoint
    keep = gate(2, torch.log(torch.tensor([[0.9], [0.5], [0.51]])))
    assert keep.tolist() == [False, False, True] and gate.stage == [0, 1, None]
    keep = gate(6, torch.log(torch.tensor([[1.0], [1.0], [0.75]])))
    assert gate.stage == [0, 1, 2] and not keep.any()
    assert gate.conf[2] == pytest.approx([0.9, 0.51, 0.75])
    # recording / no_pruning: stages are noted, nothing stops
    rec = _Gate(cfg, 1, stop=False)
    assert rec(1, torch.tensor([[math.log(0.1)]])) is None and rec.stage == [0]


@pytest.fixture(scope="module")
def parts(ref_model):
    embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.05
    g = torch.Generator().manual_seed(0)
    n = 40
    aux = torch.randn(n, 3 * HIDDEN, generator=g)
    toks = np.arange(1000, 1000 + n + 1, dtype=np.int64)
    return ref_model, embed, aux, toks


def _proposer(parts, n=60, **opts) -> GraftProposer:
    ref_model, embed, _, _ = parts
    prop = GraftProposer(GraftConfig(**opts), proposer_ctx(ref_model, VOCAB, HIDDEN, embed, n=n))
    # every token has 8 distinct successors, so retrieval never runs dry
    g = torch.Generator().manual_seed(2)
    toks = torch.arange(VOCAB)
    succ = torch.stack([torch.randperm(VOCAB, generator=g)[:8] for _ in range(4)])
    prop.adjacency.pristine.update(toks, succ[toks % 4])  # a warm start
    return prop


def _step(prop, parts, rid="a"):
    from vllm_specplug.engine.interface import StepRequest

    _, _, aux, toks = parts
    prop.add_request(rid)
    req = StepRequest(req_id=rid, token_ids=toks, num_prompt_tokens=len(toks) - 1,
                      sampled=True, verified_pos=0, aux_hidden=aux)
    return propose(prop, [req])[0]


@pytest.mark.parametrize("n,thresholds,expect", [
    (60, [1.0, 1.0, 1.0], (8, 52)),   # pruned at the root step
    (60, [0.0, 1.0, 1.0], (24, 36)),  # after the first expansion
    (60, [0.0, 0.0, 1.0], (40, 20)),  # after the fifth
    (60, [0.0, 0.0, 0.0], (60, 0)),   # never: the base tree alone
    (16, [1.0, 1.0, 1.0], (2, 14)),   # other budgets scale the split
    (16, [0.0, 1.0, 1.0], (6, 10)),
])
def test_merged_tree_has_the_stage_node_counts(parts, n, thresholds, expect):
    prop = _proposer(parts, n=n, thresholds=thresholds)
    tree = _step(prop, parts)
    tree.validate()
    src = Counter(tree.sources)
    assert len(tree) == n and (src["eagle3"], src["adjacency"]) == expect
    assert sum(prop.stage_steps) == 1
    # siblings are unique: merged (parent, token) pairs are one node
    assert len(set(zip(tree.parents, tree.tokens))) == len(tree)


def test_retrieval_reads_the_requests_own_tenant_table(parts):
    """Tenant A's prompt teaches the adjacency table A's; in one batch, A's
    next request retrieves from it and B's (same tokens) finds nothing,
    as a request without a tenant."""
    from vllm_specplug.engine.interface import StepRequest

    ref_model, embed, aux, toks = parts
    prop = GraftProposer(GraftConfig(thresholds=[1.0, 1.0, 1.0]),  # pruned at d0: 8 + 52
                         proposer_ctx(ref_model, VOCAB, HIDDEN, embed, n=60))
    chain = torch.as_tensor(toks[:-1])
    teach = torch.stack([chain + 1 + r for r in range(8)], dim=1)  # t -> t+1, t+2, ...
    propose(prop, [StepRequest(req_id="a1", token_ids=toks, num_prompt_tokens=40,
                               sampled=False, verified_pos=0, aux_hidden=aux,
                               topk_ids=teach, tenant="t:a")])
    batch = [StepRequest(req_id=rid, token_ids=toks[:21], num_prompt_tokens=20, sampled=True,
                         verified_pos=0, aux_hidden=aux[:20], tenant=tenant)
             for rid, tenant in (("a2", "t:a"), ("b1", "t:b"), ("n1", None))]
    a2, b1, n1 = propose(prop, batch)
    retrieved = [Counter(t.sources)["adjacency"] for t in (a2, b1, n1)]
    assert retrieved[0] > 0 and retrieved[1:] == [0, 0]
    assert 1021 in a2.tokens  # the successor A's prompt taught for the root 1020
    for rid in ("a1", "a2", "b1", "n1"):
        prop.remove_request(rid)
    assert prop.adjacency.num_requests == 0


def test_pruning_saves_head_rows_and_ablations(parts):
    rows = {}
    for name, opts in {"full": dict(thresholds=[0.0, 0.0, 0.0]),
                       "d0": dict(thresholds=[1.0, 1.0, 1.0]),
                       "d1": dict(thresholds=[0.0, 1.0, 1.0]),
                       "no_pruning": dict(thresholds=[1.0, 1.0, 1.0], ablation="no_pruning",
                                          fixed_stage=1),
                       "no_retrieval": dict(thresholds=[0.0, 1.0, 1.0],
                                            ablation="no_retrieval")}.items():
        prop = _proposer(parts, **opts)
        tree = _step(prop, parts)
        rows[name] = prop.runtime.stats.head_rows
        src = Counter(tree.sources)
        if name == "no_pruning":  # the fixed split, head never stopped
            assert (src["eagle3"], src["adjacency"]) == (24, 36)
        if name == "no_retrieval":
            assert len(tree) == 24 and set(tree.sources) == {"eagle3"}
    assert rows["d0"] == 0 < rows["d1"] < rows["full"]
    assert rows["no_pruning"] == rows["full"] and rows["no_retrieval"] == rows["d1"]


def test_start_up_errors_name_the_key(tmp_path):
    def start(**opts):
        return resolve({"method": "graft", "num_speculative_tokens": 60, **opts})

    for opts, key in [({"thresholds": [0.1, 0.2]}, "checkpoints"),
                      ({"checkpoints": [0, 5, 1]}, "checkpoints"),
                      ({"checkpoints": [0, 1, 8]}, "checkpoints"),
                      ({"thresholds": [0.1, 0.2, 1.5]}, "thresholds"),
                      ({"draft_nodes": [0, 24, 40]}, "draft_nodes"),
                      ({"templates": ["graft_d0", "x", "graft_d5"]}, "templates"),
                      ({"fixed_stage": 3}, "fixed_stage"),
                      ({"ablation": "no_head"}, "ablation"),
                      ({"calibration": str(tmp_path / "none.json")}, "calibration"),
                      ({"table_path": str(tmp_path / "none.safetensors")}, "table_path")]:
        with pytest.raises(SpecplugConfigError, match=rf"\['{key}'\]") as e:
            start(**opts)
        assert "\n" not in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecplugConfigError, match="calibration"):
        start(calibration=str(bad))


def test_calibration_file_replaces_thresholds(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"checkpoints": [0, 2, 4], "thresholds": [0.2, 0.3, 0.4]}))
    cfg = GraftConfig(calibration=str(path))
    assert cfg.checkpoints == [0, 2, 4] and cfg.thresholds == [0.2, 0.3, 0.4]
    again = GraftConfig(**cfg.to_dict())  # what the workers rebuild
    assert again.thresholds == cfg.thresholds


# ------------------------------------------------------------ calibration
def test_fit_finds_the_known_optimum():
    """Steps with low confidence do well on retrieval (pruned: 2 tokens,
    unpruned: 0), confident ones on the draft (pruned: 1, unpruned: 4);
    equal step costs: the best rule prunes exactly the steps with c <= 0.5."""
    from vllm_specplug.methods.graft_calibrate import fit_thresholds, objective

    rng = np.random.default_rng(0)
    conf = rng.uniform(0, 1, size=(400, 1))
    low = conf[:, 0] <= 0.5
    acc = np.stack([np.where(low, 2, 1), np.where(low, 0, 4)], axis=1).astype(float)
    t, best = fit_thresholds(conf, acc, np.array([1.0, 1.0]), grid=40)
    assert conf[low, 0].max() <= t[0] < conf[~low, 0].min()
    assert best == pytest.approx(objective(conf, acc, np.array([1.0, 1.0]), t))
    assert best == pytest.approx(((1 + acc[low, 0]).sum() + (1 + acc[~low, 1]).sum()) / 400)
    # pruning is free in tokens but saves head time: with an expensive
    # unpruned step it prunes everything
    t, _ = fit_thresholds(conf, np.ones((400, 2)), np.array([1.0, 5.0]))
    assert t[0] >= conf.max()
    # a checkpoint never reached (NaN) never prunes
    conf2 = np.concatenate([conf, np.full((400, 1), np.nan)], axis=1)
    acc2 = np.concatenate([acc[:, :1], np.full((400, 1), 9.0), acc[:, 1:]], axis=1)
    t2, best2 = fit_thresholds(conf2, acc2, np.array([1.0, 1.0, 1.0]), grid=40)
    assert best2 == pytest.approx(best)


def test_recorded_steps_round_trip(parts, tmp_path):
    """Recording mode logs every drafted step's confidences and each
    stage's accepted length once the request's next tokens are known, and
    the fitted file loads back as the method's thresholds."""
    from vllm_specplug.engine.interface import StepRequest
    from vllm_specplug.methods.graft_calibrate import fit_thresholds, read_records

    rec = tmp_path / "rec.jsonl"
    prop = _proposer(parts, record=str(rec))
    tree = _step(prop, parts)  # verified_pos 0: a prompt of 40 + the sampled token
    _, _, aux, toks = parts
    # the target "accepted" the first path of the pruned-at-d0 tree's draft part
    truth = [tree.tokens[0]] + [int(t) for t in np.arange(5, 20)]
    longer = np.concatenate([toks, truth]).astype(np.int64)
    prop.runtime.remove("a")  # a fresh state: only the recorder matters here
    prop.runtime.add("a")
    req = StepRequest(req_id="a", token_ids=longer, num_prompt_tokens=40, sampled=False,
                      verified_pos=0, aux_hidden=torch.randn(len(longer) - 1, 3 * HIDDEN))
    propose(prop, [req])
    prop.remove_request("a")
    conf, acc = read_records(str(rec))
    assert conf.shape == (1, 3) and acc.shape == (1, 4)
    assert acc[0, 3] >= 1  # the unpruned tree holds the first true token
    t, _ = fit_thresholds(conf, acc, np.array([1.0, 1.0, 1.0, 1.0]))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"checkpoints": [0, 1, 5], "thresholds": t}))
    assert GraftConfig(calibration=str(cal)).thresholds == t
