"""A streaming-input session sends each next chunk as a new request under
the same id (vLLM's ``_update_streaming_request``). The runner's request
bookkeeping (``_update_states``) frees the method state of the chunk before,
so a chunk that opts out of speculation leaves nothing behind, and a later
chunk that opts in again starts afresh."""

from __future__ import annotations
from tests.helpers.fake_vllm_runner import FakeVllmRunner

from types import SimpleNamespace

from vllm_specplug.engine.interface import ProposerContext
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.methods.pld import PLDConfig, PLDProposer
from vllm_specplug.runner.guard import ProposeGuard
from vllm_specplug.runner.runner import SpecplugRunnerMixin
from vllm_specplug.runner.step_state import RequestBook, StepClock


class Live(PLDProposer):
    """pld that keeps the set of requests it holds state for."""

    def __init__(self, *a):
        super().__init__(*a)
        self.live: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def add_request(self, rid):
        self.calls.append(("add", rid))
        self.live.add(rid)

    def remove_request(self, rid):
        self.calls.append(("remove", rid))
        self.live.discard(rid)


class _Runner(SpecplugRunnerMixin, FakeVllmRunner):
    pass


def _runner(prop):
    r = object.__new__(_Runner)
    r._sp_proposer, r._sp_stats = prop, TreeStats()
    r._sp_budget = SimpleNamespace(forget=lambda rid: None)
    r._sp_requests, r._sp_clock = RequestBook(), StepClock()
    r.requests, r.input_batch = {}, SimpleNamespace(req_ids=[])
    r.parallel_config = SimpleNamespace(tensor_parallel_size=1)
    r._sp_guard = ProposeGuard(100, r._sp_stats, max_request_faults=3)
    return r


def _chunk(rid, speculate=True, finished=()):
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, extra_args={"specplug_speculate": speculate})
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, sampling_params=params)],
        finished_req_ids=set(finished), preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=[]))


def _ctx():
    return ProposerContext(vocab_size=100, hidden_size=8, num_speculative_tokens=4,
                           max_model_len=64, device="cpu", dtype=None, model_path="",
                           tokenizer_path="")


def test_an_opted_out_chunk_frees_the_state_of_the_chunk_before():
    prop = Live(PLDConfig(), _ctx())
    r = _runner(prop)
    r._update_states(_chunk("s"))
    assert prop.live == {"s"} and r._sp_requests.opted_out == set()
    r._sp_requests.trees["s"] = object()  # a draft for the chunk before
    r._update_states(_chunk("s", speculate=False))
    assert prop.live == set() and r._sp_requests.opted_out == {"s"} and "s" not in r._sp_requests.trees
    assert r._sp_silent() == {"s"}


def test_a_chunk_opting_in_again_starts_afresh():
    prop = Live(PLDConfig(), _ctx())
    r = _runner(prop)
    r._update_states(_chunk("s", speculate=False))
    r._update_states(_chunk("s", speculate=False))
    assert prop.calls == [] and r._sp_requests.opted_out == {"s"}  # the method never saw it
    r._update_states(_chunk("s"))
    assert prop.calls == [("add", "s")] and r._sp_requests.opted_out == set()
    r._update_states(_chunk("s"))  # the next chunk: removed, then added again
    assert prop.calls == [("add", "s"), ("remove", "s"), ("add", "s")]
    assert prop.live == {"s"}


def test_a_new_id_is_not_removed_first():
    prop = Live(PLDConfig(), _ctx())
    r = _runner(prop)
    r._update_states(_chunk("a"))
    r._update_states(_chunk("b"))
    assert prop.calls == [("add", "a"), ("add", "b")]
