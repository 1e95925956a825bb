"""Faults in the method's hooks stay contained: ``ProposeGuard.call`` counts
and logs them, a request that faults ``max_request_faults`` times in a row
stops drafting while the others keep drafting, and the runner's request
bookkeeping (``_update_states``) survives raising ``add_request`` /
``remove_request`` and keeps opted-out requests away from the method.
(The engine-level checks are in tests/serving/test_request_control.py.)"""

from __future__ import annotations
from tests.helpers.fake_vllm_runner import FakeVllmRunner

from types import SimpleNamespace

import numpy as np

from vllm_specplug.engine.budget import FixedBudget
from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.methods.pld import PLDConfig, PLDProposer
from vllm_specplug.runner.guard import ProposeGuard
from vllm_specplug.runner.runner import SpecplugRunnerMixin
from vllm_specplug.runner.step_state import RequestBook, RequestPlan, StepClock


class Recording(PLDProposer):
    """Real pld that records what it sees and fails on demand."""

    def __init__(self, *a):
        super().__init__(*a)
        self.seen: list[str] = []
        self.added: list[str] = []
        self.removed: list[str] = []
        self.fail_propose: set[str] = set()
        self.fail_add: set[str] = set()
        self.fail_remove: set[str] = set()

    def add_request(self, rid):
        self.added.append(rid)
        if rid in self.fail_add:
            raise RuntimeError(f"add {rid}")

    def remove_request(self, rid):
        self.removed.append(rid)
        if rid in self.fail_remove:
            raise RuntimeError(f"remove {rid}")

    def propose(self, batch):
        self.seen.extend(r.req_id for r in batch)
        if any(r.req_id in self.fail_propose for r in batch):
            raise RuntimeError("propose")
        return super().propose(batch)


def _ctx():
    return ProposerContext(vocab_size=100, hidden_size=8, num_speculative_tokens=4,
                           max_model_len=64, device="cpu", dtype=None, model_path="",
                           tokenizer_path="")


def _req(rid):
    toks = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int64)
    return StepRequest(req_id=rid, token_ids=toks, num_prompt_tokens=8, sampled=True,
                       verified_pos=7, budget=4)


def _step(guard, prop, rids=("a", "bad", "b")):
    batch = [_req(r) for r in rids]
    trees = guard.propose(prop, batch, skip=guard.stopped)
    return dict(zip(rids, trees)), guard.take_stopped()


def test_call_counts_logs_once_and_returns_the_default(caplog):
    stats = TreeStats()
    guard = ProposeGuard(100, stats, max_request_faults=3, method="m")

    def boom():
        raise ValueError("x")

    assert guard.call("add_request", lambda: 7, "r") == 7
    assert guard.call("add_request", boom, "r") is None
    assert guard.call("add_request", boom, "r", default=0) == 0
    assert guard.call("remove_request", boom, None) is None
    assert stats.hook_faults == 3
    assert guard.streaks == {"r": 2}  # the call without a request counts for none
    logged = [r.message for r in caplog.records if "failed in" in r.message]
    assert len(logged) == 2  # once per hook
    assert "'m' failed in add_request" in logged[0] and "request r" in logged[0]


def test_request_failing_n_times_in_a_row_stops_drafting_others_keep_drafting():
    stats = TreeStats()
    guard = ProposeGuard(100, stats, max_request_faults=3)
    prop = Recording(PLDConfig(), _ctx())
    prop.fail_propose = {"bad"}
    for step in range(1, 4):
        trees, stopped = _step(guard, prop)
        assert trees["bad"] is None and trees["a"] is not None and trees["b"] is not None
        assert stopped == ([] if step < 3 else ["bad"])
    assert stats.requests_stopped_drafting == 1 and guard.stopped == {"bad"}
    assert (stats.propose_faults, stats.fault_requests) == (3, 3)
    prop.seen.clear()
    for _ in range(2):
        trees, stopped = _step(guard, prop)
        assert trees["bad"] is None and trees["a"] is not None and trees["b"] is not None
        assert stopped == []
    assert "bad" not in prop.seen and prop.seen.count("a") == 2
    assert (stats.propose_faults, stats.requests_stopped_drafting) == (3, 1)
    guard.forget("bad")  # finished: a new request of that id starts afresh
    assert guard.stopped == set() and guard.streaks == {}


def test_a_success_resets_the_streak():
    stats = TreeStats()
    guard = ProposeGuard(100, stats, max_request_faults=3)
    prop = Recording(PLDConfig(), _ctx())
    for fails in (True, True, False, True, True):
        prop.fail_propose = {"bad"} if fails else set()
        _, stopped = _step(guard, prop)
        assert stopped == []
    assert guard.streaks == {"bad": 2} and stats.requests_stopped_drafting == 0


def test_zero_never_stops_a_request():
    stats = TreeStats()
    guard = ProposeGuard(100, stats, max_request_faults=0)
    prop = Recording(PLDConfig(), _ctx())
    prop.fail_propose = {"bad"}
    for _ in range(10):
        assert _step(guard, prop)[1] == []
    assert stats.requests_stopped_drafting == 0 and stats.propose_faults == 10


def test_hook_faults_count_towards_the_streak():
    stats = TreeStats()
    guard = ProposeGuard(100, stats, max_request_faults=2)
    prop = Recording(PLDConfig(), _ctx())
    prop.fail_add = {"bad"}
    guard.call("add_request", lambda: prop.add_request("bad"), "bad")
    prop.fail_propose = {"bad"}
    assert _step(guard, prop)[1] == ["bad"]
    # the reset after the propose fault (remove + add) failed once more:
    # counted, not added to the streak a second time
    assert stats.hook_faults == 2 and stats.requests_stopped_drafting == 1


# ------------------------------------------------------------ the runner
class _Runner(SpecplugRunnerMixin, FakeVllmRunner):
    pass


def _runner(prop, max_request_faults=3):
    r = object.__new__(_Runner)
    r._sp_proposer, r._sp_stats, r._sp_budget = prop, TreeStats(), FixedBudget()
    r._sp_requests, r._sp_clock = RequestBook(), StepClock()
    r.requests, r.input_batch = {}, SimpleNamespace(req_ids=[])
    r.parallel_config = SimpleNamespace(tensor_parallel_size=1)
    r._sp_guard = ProposeGuard(100, r._sp_stats, max_request_faults=max_request_faults)
    return r


def _sched(new=(), finished=(), preempted=(), resumed=(), xargs=None):
    from vllm.sampling_params import SamplingParams

    reqs = [SimpleNamespace(req_id=rid, sampling_params=SamplingParams(
        max_tokens=4, extra_args=(xargs or {}).get(rid))) for rid in new]
    return SimpleNamespace(
        scheduled_new_reqs=reqs, finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=list(resumed)))


def test_runner_survives_add_and_remove_faults():
    prop = Recording(PLDConfig(), _ctx())
    prop.fail_add, prop.fail_remove = {"x"}, {"x", "y"}
    r = _runner(prop)
    assert r._update_states(_sched(new=["x", "y", "z"])) == "vllm's"
    assert prop.added == ["x", "y", "z"] and r._sp_stats.hook_faults == 1
    r._update_states(_sched(preempted=["x"]))  # remove raises: counted
    r._update_states(_sched(resumed=["x"]))  # remove raises: the 3rd in a row
    assert r._sp_guard.stopped == {"x"} and r._sp_stats.requests_stopped_drafting == 1
    assert prop.added == ["x", "y", "z"]  # not added again once stopped
    assert prop.removed == ["x", "x", "x"]  # its state freed once more when it stopped
    assert r._sp_stats.hook_faults == 4
    r._update_states(_sched(finished=["x", "y"]))  # y's remove raises; x is unseen
    assert prop.removed == ["x", "x", "x", "y"] and r._sp_stats.hook_faults == 5
    assert r._sp_guard.stopped == set() and "y" not in r._sp_guard.streaks


def test_opted_out_request_never_reaches_the_method():
    prop = Recording(PLDConfig(), _ctx())
    r = _runner(prop)
    r._update_states(_sched(new=["a", "off", "off1"], xargs={
        "off": {"specplug_speculate": False}, "off1": {"specplug_speculate": 0},
        "a": {"specplug_speculate": 1}}))
    assert prop.added == ["a"] and r._sp_requests.opted_out == {"off", "off1"}
    assert r._sp_silent() == {"off", "off1"}
    r._update_states(_sched(preempted=["off", "a"]))
    r._update_states(_sched(resumed=["off", "a"]))
    r._update_states(_sched(finished=["off", "off1", "a"]))
    assert set(prop.added) == {"a"} and set(prop.removed) == {"a"}
    assert r._sp_requests.opted_out == set()


def test_explorer_skips_silent_requests_and_survives_catch_up_faults():
    class Catchup(Recording):
        def catch_up_rows(self, rid, n):
            if rid == "bad":
                raise RuntimeError("catch up")
            return 5

    r = _runner(Catchup(PLDConfig(), _ctx()))
    r.input_batch.req_ids = ["off", "bad", "a"]
    plan = [RequestPlan(scheduled=1, computed=0, prompt_len=0, decoding=True, rows=[0],
                        first_row=0)] * 3
    picks = [r._sp_pick_explorer(plan, [[1], [1], [1]], {"off"}) for _ in range(6)]
    assert 0 not in picks and set(picks) == {1, 2}
    # the 3rd fault in a row stopped it: the method is not asked again
    assert r._sp_stats.hook_faults == 3 and r._sp_guard.stopped == {"bad"}
