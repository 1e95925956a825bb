"""`eagle3_tree` without an engine: start-up errors and the proposer's glue
(aux rows in, trees out) on the shipped head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.contexts import proposer_ctx, ref_model_ctx
from tests.methods.budget import propose

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.registry import resolve as split_speculative_config
from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.methods.eagle3_tree import Eagle3TreeConfig, Eagle3TreeProposer
from vllm_specplug.sources.eagle3_drafter import default_held_rows


def _step(prop, toks, aux, n_prompt: int, pos: int, n: int, budget: int,
          sampled: bool = True, drafting: bool = True):
    """One step of request "a": rows ``pos .. pos+n-1`` verified."""
    r = StepRequest(req_id="a", token_ids=toks[:pos + n + 1], num_prompt_tokens=n_prompt,
                    sampled=sampled, verified_pos=pos, aux_hidden=aux[pos:pos + n],
                    budget=budget, drafting=drafting)
    return prop.propose([r])[0]


def test_unknown_target_needs_a_head(tiny_model):
    with pytest.raises(SpecplugConfigError, match=r"\['head'\] is required"):
        Eagle3TreeProposer(Eagle3TreeConfig(),
                           proposer_ctx(tiny_model, 512, 256, torch.zeros(512, 256)))


def test_bad_options_fail_in_one_line(tmp_path):
    with pytest.raises(SpecplugConfigError, match="no EAGLE-3 head"):
        split_speculative_config({"method": "eagle3_tree", "num_speculative_tokens": 8,
                                  "head": str(tmp_path)})
    with pytest.raises(SpecplugConfigError, match="topk"):
        split_speculative_config({"method": "eagle3_tree", "num_speculative_tokens": 8,
                                  "topk": 0})


def test_proposer_feeds_every_request_and_respects_budgets(ref_model):
    """Two requests in one step: both states extend from their rows, the
    one near max_model_len gets a smaller tree, an unsampled chunk none."""
    from vllm_specplug.eagle3 import shipped_head_path

    ctx = ref_model_ctx(ref_model)
    ctx.max_model_len = 70
    prop = Eagle3TreeProposer(Eagle3TreeConfig(depth=4, topk=4), ctx)
    assert prop.needs().aux_layers == (2, 15, 27)
    assert prop.head_dir == shipped_head_path()
    g = torch.Generator().manual_seed(0)
    batch = []
    for rid, n, sampled in (("a", 30, True), ("b", 64, True), ("c", 20, False)):
        toks = np.arange(100, 100 + n + 1, dtype=np.int64)
        batch.append(StepRequest(req_id=rid, token_ids=toks, num_prompt_tokens=n,
                                 sampled=sampled, verified_pos=0,
                                 aux_hidden=torch.randn(n, 3 * 576, generator=g)))
    trees = propose(prop, batch)  # budgets set as the runner sets them
    assert len(trees[0]) == 16 and len(trees[1]) == 70 - 65 - 1 and trees[2] is None
    assert [prop.runtime.states[r].n for r in "abc"] == [30, 64, 20]
    prop.remove_request("a")
    assert "a" not in prop.runtime.states
    s = prop.report(prop.stats())
    assert s["extended_rows"] == 114 and s["draft"]["n"] == 1


def test_rows_without_a_draft_are_held_and_fed_at_the_next_draft(ref_model):
    """A decoding request asked for no draft (budget 0: the cost-aware gate)
    costs no head pass; its rows are fed, in order, with the next step that
    asks for a draft, and the head's state then equals a state fed every
    step (same K/V rows, same tree)."""
    ctx = ref_model_ctx(ref_model)
    g = torch.Generator().manual_seed(1)
    toks = np.arange(200, 260, dtype=np.int64)
    aux = torch.randn(59, 3 * 576, generator=g)
    held = Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2), ctx)
    every = Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2), ctx)

    def step(prop, *args, **kw):
        return _step(prop, toks, aux, 40, *args, **kw)

    for prop, budgets in ((held, [0, 0, 0, 8]), (every, [8, 8, 8, 8])):
        step(prop, 0, 40, 0, sampled=False)  # the prompt, gate open: fed
        for k, b in enumerate(budgets):
            tree = step(prop, 40 + k, 1, b)
        if prop is held:
            assert held.runtime.states["a"].n == 44
    assert every.runtime.states["a"].n == 44
    a, b = held.runtime.states["a"], every.runtime.states["a"]
    assert torch.allclose(a.k[:44], b.k[:44], atol=1e-5)
    assert torch.allclose(a.v[:44], b.v[:44], atol=1e-5)
    assert held.report(held.stats())["extended_rows"] == 44
    # while held, the state stays at the prompt
    prop = Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2), ctx)
    step(prop, 0, 40, 0, sampled=False)
    assert step(prop, 40, 1, 0) is None and prop.runtime.states["a"].n == 40
    # the step's rows arrive as a slice of the batch's gathered rows: held as
    # a copy, so the batch's tensor is not kept alive by a gated request
    (held_chunk,) = prop._deferred["a"][1]
    assert held_chunk._base is None and torch.equal(held_chunk, aux[40:41])
    # a recomputed row (the target verified position 41 again) replaces the held one
    step(prop, 41, 1, 0)
    step(prop, 41, 1, 8)
    assert prop.runtime.states["a"].n == 42
    # held rows are bounded: past max_held_rows they are fed without a draft
    prop = Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2, max_held_rows=2), ctx)
    step(prop, 0, 40, 0, sampled=False)
    assert step(prop, 40, 1, 0) is None and step(prop, 41, 1, 0) is None
    assert prop.runtime.states["a"].n == 40  # two rows held
    assert step(prop, 42, 1, 0) is None  # a third: all three fed, still no draft
    assert prop.runtime.states["a"].n == 43 and "a" not in prop._deferred
    # a prompt chunk while the gate is closed is held too, and fed with the
    # first draft: the same head state as a prompt fed at once
    gated = Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2), ctx)
    step(gated, 0, 20, 0, sampled=False, drafting=False)
    step(gated, 20, 20, 0, sampled=False, drafting=False)
    assert "a" not in gated.runtime.states or gated.runtime.states["a"].n == 0
    for k, budget in enumerate([0, 0, 0, 8]):
        step(gated, 40 + k, 1, budget)
    c, want = gated.runtime.states["a"], every.runtime.states["a"]
    assert c.n == 44 and torch.allclose(c.k[:44], want.k[:44], atol=1e-5)
    assert torch.allclose(c.v[:44], want.v[:44], atol=1e-5)


def test_catch_up_rows_count_what_the_head_holds(ref_model):
    """``catch_up_rows``: the rows a gated request holds plus this step's
    (what its next draft would first feed the head); 0 + new once fed. The
    default bound holds a 1200-token prompt of the reference model (16 MiB:
    2427 rows of 3 x 576 floats), which a bound of 1024 rows would not."""
    ctx = ref_model_ctx(ref_model)
    g = torch.Generator().manual_seed(3)
    toks = np.arange(100, 1400, dtype=np.int64)
    aux = torch.randn(1250, 3 * 576, generator=g)
    prop = Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2), ctx)
    assert prop.max_held_rows == 2427  # 16 MiB of 3 x 576 float32 features
    assert Eagle3TreeProposer(Eagle3TreeConfig(depth=3, topk=2, max_held_rows=5),
                              ctx).max_held_rows == 5
    assert default_held_rows(3, 4096) == 1024  # a wide target: at least 1024 rows

    def step(*args, **kw):
        return _step(prop, toks, aux, 1200, *args, **kw)

    assert prop.catch_up_rows("a", 7) == 7  # nothing held yet
    step(0, 1200, 0, drafting=False)  # a closed gate: the whole prompt held
    assert "a" not in prop.runtime.states or prop.runtime.states["a"].n == 0
    assert prop.catch_up_rows("a", 1) == 1201
    step(1200, 1, 0)
    assert prop.catch_up_rows("a", 1) == 1202
    assert step(1201, 1, 8) is not None  # a draft: all fed first
    assert prop.runtime.states["a"].n == 1202 and prop.catch_up_rows("a", 1) == 1


def test_head_stops_deepening_where_a_level_is_worth_less_than_its_pass(ref_model):
    """``StepRequest.token_seconds``: with a token worth far less than a
    level's measured time the head drafts one level only; unknown (0) or
    worth a lot, it drafts to its full depth."""
    ctx = ref_model_ctx(ref_model)
    g = torch.Generator().manual_seed(2)
    toks = np.arange(300, 341, dtype=np.int64)
    aux = torch.randn(40, 3 * 576, generator=g)

    def depth_of_tree(token_seconds: float) -> int:
        prop = Eagle3TreeProposer(Eagle3TreeConfig(depth=5, topk=1), ctx)
        prop.runtime.level_seconds = 0.010  # as measured by an earlier draft
        r = StepRequest(req_id="a", token_ids=toks, num_prompt_tokens=40, sampled=True,
                        verified_pos=0, aux_hidden=aux, budget=8,
                        token_seconds=token_seconds)
        tree = prop.propose([r])[0]
        stopped = prop.runtime.stats.stopped_cost
        assert (stopped > 0) == (int(tree.depths().max()) < 5)
        return int(tree.depths().max())

    assert depth_of_tree(0.0) == 5  # unknown: no cost stop
    assert depth_of_tree(1e3) == 5  # a token worth 1000 s: every level pays
    assert depth_of_tree(1e-6) == 1  # worth 1 us against a 10 ms level
