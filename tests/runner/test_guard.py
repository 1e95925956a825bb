"""The runner's guard around ``propose`` (the engine-level test is
tests/serving/test_robustness.py): isolation of the failing request, reset
of its state, invalid trees, counters."""

from __future__ import annotations

import numpy as np

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.methods.pld import PLDConfig, PLDProposer
from vllm_specplug.runner.guard import ProposeGuard
from vllm_specplug.engine.interface import ProposerContext


class FlakyPLD(PLDProposer):
    """Real pld, plus a request that makes it raise and a bogus token."""

    def __init__(self, *a):
        super().__init__(*a)
        self.removed, self.added = [], []

    def remove_request(self, rid):
        self.removed.append(rid)

    def add_request(self, rid):
        self.added.append(rid)

    def propose(self, batch):
        if any(r.req_id == "bad" for r in batch):
            raise KeyError("boom")
        out = super().propose(batch)
        return [DraftTree([10**6], [-1]) if r.req_id == "oov" else t
                for r, t in zip(batch, out)]


def _req(rid):
    toks = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int64)
    return StepRequest(req_id=rid, token_ids=toks, num_prompt_tokens=8, sampled=True,
                       verified_pos=7, budget=4)  # as the runner sets it


def _proposer():
    ctx = ProposerContext(vocab_size=100, hidden_size=8, num_speculative_tokens=4,
                          max_model_len=64, device="cpu", dtype=None, model_path="",
                          tokenizer_path="")
    return FlakyPLD(PLDConfig(), ctx)


def test_failing_request_is_isolated_and_reset(caplog):
    stats, published = TreeStats(), []
    guard = ProposeGuard(100, stats, lambda c, force: published.append((c, force)))
    prop = _proposer()
    plain = PLDProposer(PLDConfig(), prop.ctx).propose([_req("a")])[0]
    trees = guard.propose(prop, [_req("a"), _req("bad"), _req("oov"), _req("b")])
    assert trees[0].tokens == plain.tokens and trees[3].tokens == plain.tokens
    assert trees[1] is None and trees[2] is None
    assert (stats.propose_faults, stats.fault_requests) == (1, 2)
    assert prop.removed == ["bad"] and prop.added == ["bad"]
    assert published[-1] == ({"propose_faults": 1, "fault_requests": 2,
                              "rank_divergences": 0, "hook_faults": 0,
                              "requests_stopped_drafting": 0}, True)
    guard.propose(prop, [_req("bad")])
    assert stats.propose_faults == 2
    assert sum("failed in propose" in r.message for r in caplog.records) == 1


def test_healthy_steps_count_nothing():
    stats = TreeStats()
    guard = ProposeGuard(100, stats)
    assert guard.propose(_proposer(), [_req("a")])[0] is not None
    assert (stats.propose_faults, stats.fault_requests) == (0, 0)
