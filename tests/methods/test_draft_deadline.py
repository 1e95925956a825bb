"""The per-step drafting time budget (``max_draft_ms``), on a fake clock:
once a step's budget is spent the remaining requests get no draft, and
they go first the next step."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.config import MethodConfig
from vllm_specplug.engine.interface import DraftDeadline
from vllm_specplug.methods.adapld import AdaPLDConfig, AdaPLDProposer
from tests.methods.budget import propose
from tests.helpers.retrieval_steps import make_ctx, step


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(req_id):
    return type("Req", (), {"req_id": req_id})()


def test_budget_refuses_the_rest_once_spent_and_rotates():
    clock = FakeClock()
    d = DraftDeadline(10.0, clock)
    batch = [_req(x) for x in "abcd"]
    assert d.order(batch) == [0, 1, 2, 3]
    allowed = []
    for i in (0, 1, 2, 3):
        ok = d.allows(batch[i].req_id)
        allowed.append(ok)
        clock.now += 0.006 if ok else 0.0  # each draft costs 6 ms
    assert allowed == [True, True, False, False] and d.skipped == 2
    # next step: the refused requests first, then the others in batch order
    assert d.order(batch) == [2, 3, 0, 1]
    assert d.allows("c") and d.skipped == 2


def test_zero_means_no_limit_and_the_option_defaults():
    clock = FakeClock()
    d = DraftDeadline(0.0, clock)
    d.order([_req("a")])
    clock.now = 1e6
    assert d.allows("a") and d.skipped == 0
    assert MethodConfig().max_draft_ms == 50.0
    with pytest.raises(ValueError):
        MethodConfig(max_draft_ms=-1.0)


def _copy_request(req_id, extra=()):
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 30, 1, 2, 3, 4, *extra]
    return step(tokens, req_id=req_id)


def test_adapld_skips_the_requests_past_the_budget():
    p = AdaPLDProposer(AdaPLDConfig(max_draft_ms=10.0), make_ctx(8))
    clock = FakeClock()
    p.deadline = DraftDeadline(10.0, clock)
    drafted = []
    real = p._draft

    def draft_costing_6ms(req, mem):
        drafted.append(req.req_id)
        clock.now += 0.006
        return real(req, mem)

    p._draft = draft_costing_6ms
    trees = propose(p, [_copy_request(x) for x in "abcd"])
    assert drafted == ["a", "b"]
    assert [t is not None for t in trees] == [True, True, False, False]
    assert trees[0].tokens[:4] == [5, 6, 7, 8]  # a copy from the earlier 1 2 3 4
    assert p.report()["deadline_skips"] == 2
    # every memory is kept up to date, drafted or not
    assert all(p.memories.get(x).total == 13 for x in "abcd")
    # next step: c and d go first
    drafted.clear()
    clock.now = 100.0
    trees = propose(p, [_copy_request(x, [5]) for x in "abcd"])
    assert drafted == ["c", "d"]
    assert [t is not None for t in trees] == [False, False, True, True]


def test_adapld_lookup_window_finds_only_recent_suffix_matches():
    """``max_lookup_tokens``: the suffix match does not see an occurrence
    older than the window (retrieval from the request's memory still may);
    one inside it is found at its absolute position."""
    old = [1, 2, 3, 4, 50, 51]
    filler = list(range(100, 140))
    tokens = old + filler + [1, 2, 3, 4]
    far = AdaPLDProposer(AdaPLDConfig(branch_width=0), make_ctx(4))
    near = AdaPLDProposer(AdaPLDConfig(branch_width=0, max_lookup_tokens=20), make_ctx(4))
    assert propose(far, [step(tokens)])[0].tokens == [50, 51, 100, 101]
    assert far.report()["suffix_anchors"] == 1
    propose(near, [step(tokens)])
    assert near.report()["suffix_anchors"] == 0
    recent = old + filler + [1, 2, 3, 4, 60, 61] + [1, 2, 3, 4]
    tree = propose(near, [step(recent, req_id="y")])[0]
    assert tree.tokens[:2] == [60, 61] and near.report()["suffix_anchors"] == 1


def test_reader_keeps_the_head_tree_alone_past_the_budget(monkeypatch):
    """Past the budget a reader request gets the head's tree (already made
    in the batched pass) without the search paths."""
    from vllm_specplug.engine.interface import Proposer
    from vllm_specplug.engine.tree import DraftTree
    from vllm_specplug.sources.eagle3_drafter import Eagle3Drafter
    from vllm_specplug.methods.reader import ReaderConfig, ReaderProposer

    head = {x: DraftTree([10], [-1], scores=[-0.1], sources=["eagle3"]) for x in "abc"}
    monkeypatch.setattr(Eagle3Drafter, "__init__", Proposer.__init__)
    monkeypatch.setattr(Eagle3Drafter, "propose",
                        lambda self, batch, drafting=None: [head[r.req_id] for r in batch])
    monkeypatch.setattr(Eagle3Drafter, "stats", Proposer.stats)
    p = ReaderProposer(ReaderConfig(d_search=3, d_deep=0, l_suffix=2), make_ctx(8))
    clock = FakeClock()
    p.deadline = DraftDeadline(10.0, clock)
    real = p._merge

    def merge_costing_6ms(r, d):
        clock.now += 0.006
        return real(r, d)

    p._merge = merge_costing_6ms
    batch = [step([1, 2, 3, 1, 2, 3, 1, 2], req_id=x) for x in "abc"]
    trees = propose(p, batch)
    # the head's node, then the search path: 1 2 -> 3, 2 3 -> 1, 3 1 -> 2
    for t in trees[:2]:
        assert t.tokens == [10, 3, 1, 2] and t.sources == ["eagle3"] + ["search"] * 3
    assert trees[2] is head["c"]
    assert p.report()["deadline_skips"] == 1
