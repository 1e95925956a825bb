"""The workers' counters reach the front end's /metrics on vLLM's own stats
path (worker output -> engine-core scheduler stats -> stat logger), each leg
checked with vLLM's real objects and transports: pickle between worker and
engine core, msgpack between engine core and front end. No engine runs here;
tests/serving/test_robustness.py and test_stats_channel_engine.py check the
whole path on a server."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from prometheus_client import REGISTRY
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.metrics import (
    COUNTERS_ATTR,
    EngineCounters,
    SpecplugStatLogger,
    WorkerCounters,
    install_front_end_hook,
    install_scheduler_hooks,
    take_worker_counters,
    valid_counters,
    worker_counters,
)


def _value(name: str, method: str = "oracle") -> float:
    return REGISTRY.get_sample_value(name, {"method": method}) or 0.0


def _logger(method: str = "oracle") -> SpecplugStatLogger:
    return SpecplugStatLogger(SimpleNamespace(
        additional_config={"specplug": {"method": method, "options": {}}}))


def _output() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})


class StubScheduler:
    """The two methods the hooks wrap, shaped as vLLM's: update_from_output
    builds the stats through make_stats."""

    def update_from_output(self, scheduler_output, model_runner_output):
        return {0: EngineCoreOutputs(scheduler_stats=self.make_stats())}

    def make_stats(self):
        return SchedulerStats(num_kv_fetch_reqs_by_stage={"waiting_to_start": 2})


install_scheduler_hooks(StubScheduler)


def _through_msgpack(outputs: dict) -> SchedulerStats:
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    return dec.decode(enc.encode(outputs[0])).scheduler_stats


# ------------------------------------------------------------------ worker
def test_counters_attached_only_when_changed():
    channel = WorkerCounters()
    first, second, third = _output(), _output(), _output()
    assert channel.attach(first, {"propose_faults": 1})
    assert getattr(first, COUNTERS_ATTR) == {"propose_faults": 1, "epoch": channel.epoch}
    assert not channel.attach(second, {"propose_faults": 1})
    assert not hasattr(second, COUNTERS_ATTR)
    assert channel.attach(third, {"propose_faults": 2})
    assert getattr(third, COUNTERS_ATTR)["propose_faults"] == 2


def test_never_written_on_the_shared_empty_output():
    channel = WorkerCounters()
    assert not channel.attach(EMPTY_MODEL_RUNNER_OUTPUT, {"propose_faults": 1})
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, COUNTERS_ATTR)
    assert not channel.attach(None, {"propose_faults": 1})  # a PP rank's tensors, ...
    # Not sent yet, so the next real output carries them.
    out = _output()
    assert channel.attach(out, {"propose_faults": 1})


def test_async_output_carries_them_on_its_inner_output():
    inner = _output()
    wrapper = SimpleNamespace(_model_runner_output=inner)  # vLLM's async output
    assert WorkerCounters().attach(wrapper, {"hook_faults": 4})
    assert getattr(inner, COUNTERS_ATTR)["hook_faults"] == 4


def test_counters_survive_the_pickle_to_the_engine_core():
    out = _output()
    WorkerCounters().attach(out, {"fault_requests": 7})
    assert getattr(pickle.loads(pickle.dumps(out)), COUNTERS_ATTR)["fault_requests"] == 7


def test_every_integer_counter_of_the_stats_is_sent():
    stats = TreeStats()
    stats.propose_faults, stats.kv_moves, stats.rank_divergences = 2, 9, 5
    stats.some_new_counter = 3  # a counter added later needs no change here
    sent = worker_counters(stats)
    assert sent["propose_faults"] == 2 and sent["kv_moves"] == 9
    assert sent["some_new_counter"] == 3
    assert "rank_divergences" not in sent  # only other ranks count it
    assert "propose_seconds" not in sent and "accepted_depth_hist" not in sent


# ------------------------------------------------------------- engine core
def test_make_stats_hook_adds_increments_once():
    sched = StubScheduler()
    out = _output()
    WorkerCounters().attach(out, {"propose_faults": 3, "fault_requests": 5})
    stats = _through_msgpack(sched.update_from_output(None, out))
    assert stats.num_kv_fetch_reqs_by_stage == {
        "waiting_to_start": 2, "specplug:propose_faults": 3, "specplug:fault_requests": 5}
    # A step without new counters adds nothing; vLLM's own keys are untouched.
    again = sched.update_from_output(None, _output())[0].scheduler_stats
    assert again.num_kv_fetch_reqs_by_stage == {"waiting_to_start": 2}


def test_increments_between_totals_of_one_worker():
    channel, sched = WorkerCounters(), StubScheduler()
    for total in (3, 3, 8):
        out = _output()
        channel.attach(out, {"propose_faults": total})
        sched.update_from_output(None, out)
    out = _output()
    channel.attach(out, {"propose_faults": 10})
    stats = sched.update_from_output(None, out)[0].scheduler_stats
    assert stats.num_kv_fetch_reqs_by_stage["specplug:propose_faults"] == 2


def test_a_restarted_worker_counts_from_zero():
    engine = EngineCounters()
    engine.observe(SimpleNamespace(**{COUNTERS_ATTR: {"propose_faults": 6, "epoch": 1}}))
    assert engine.increments() == {"specplug:propose_faults": 6}
    # A new worker process (another epoch) at 2: two more, not 2 - 6.
    engine.observe(SimpleNamespace(**{COUNTERS_ATTR: {"propose_faults": 2, "epoch": 2}}))
    assert engine.increments() == {"specplug:propose_faults": 2}
    engine.observe(SimpleNamespace(**{COUNTERS_ATTR: {"propose_faults": 5, "epoch": 2}}))
    assert engine.increments() == {"specplug:propose_faults": 3}


def test_malformed_counters_are_dropped_not_raised():
    sched = StubScheduler()
    out = _output()
    setattr(out, COUNTERS_ATTR, {"propose_faults": "many", "fault_requests": 1.5,
                                 "hook_faults": -1, "kv_moves": 1 << 70, "ok": True,
                                 "Bad-Name": 1, "x_total": 1, 7: 1, "preempted": 4,
                                 "epoch": [1]})
    stats = _through_msgpack(sched.update_from_output(None, out))
    assert stats.num_kv_fetch_reqs_by_stage == {"waiting_to_start": 2,
                                                "specplug:preempted": 4}
    broken = _output()
    setattr(broken, COUNTERS_ATTR, "not a dict")
    stats = sched.update_from_output(None, broken)[0].scheduler_stats
    assert stats.num_kv_fetch_reqs_by_stage == {"waiting_to_start": 2}
    assert valid_counters(None) == {}


def test_vllm_scheduler_is_wrapped_once():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    install_scheduler_hooks()
    wrapped = Scheduler.make_stats
    install_scheduler_hooks()
    assert Scheduler.make_stats is wrapped and wrapped._specplug
    assert AsyncScheduler.update_from_output._specplug


# --------------------------------------------------------------- front end
def test_logger_pops_the_keys_and_counts_them():
    log = _logger()
    faults, requests = (_value("specplug:propose_faults_total"),
                        _value("specplug:fault_requests_total"))
    stats = SchedulerStats(num_kv_fetch_reqs_by_stage={
        "waiting_to_start": 1, "specplug:propose_faults": 3, "specplug:fault_requests": 5})
    log.record(stats, None)
    assert stats.num_kv_fetch_reqs_by_stage == {"waiting_to_start": 1}
    assert _value("specplug:propose_faults_total") - faults == 3
    assert _value("specplug:fault_requests_total") - requests == 5
    log.record(SchedulerStats(num_kv_fetch_reqs_by_stage={"specplug:propose_faults": 2}),
               None)
    assert _value("specplug:propose_faults_total") - faults == 5


def test_logger_exports_fault_counters_from_start_up():
    _logger("pld")
    for name in ("propose_faults", "fault_requests", "hook_faults",
                 "requests_stopped_drafting"):
        assert REGISTRY.get_sample_value(f"specplug:{name}_total", {"method": "pld"}) == 0.0


def test_logger_creates_series_for_new_counters():
    log = _logger()
    log.record(SchedulerStats(num_kv_fetch_reqs_by_stage={"specplug:kv_moves": 11}), None)
    assert _value("specplug:kv_moves_total") >= 11


def test_logger_ignores_bad_values_and_tree_series_names():
    log = _logger()
    trees = _value("specplug:trees_total")
    stats = SchedulerStats(num_kv_fetch_reqs_by_stage={
        "specplug:propose_faults": "x", "specplug:trees": 4, "specplug:hook_faults": -3})
    hooks = _value("specplug:hook_faults_total")
    log.record(stats, None)
    assert stats.num_kv_fetch_reqs_by_stage == {}
    assert _value("specplug:trees_total") == trees
    assert _value("specplug:hook_faults_total") == hooks


def test_idle_logger_still_pops():
    log = SpecplugStatLogger(SimpleNamespace(additional_config={}))
    stats = SchedulerStats(num_kv_fetch_reqs_by_stage={"specplug:propose_faults": 1})
    log.record(stats, None)
    assert stats.num_kv_fetch_reqs_by_stage == {}
    assert take_worker_counters(None) == {}


def test_no_other_logger_sees_the_keys():
    """vLLM's manager hands the stats to every logger in turn (a user's own
    first): none but ours finds the counters."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    install_front_end_hook()
    seen = []
    first = SimpleNamespace(record=lambda stats, *a, **k: seen.append(
        dict(stats.num_kv_fetch_reqs_by_stage)))
    manager = StatLoggerManager.__new__(StatLoggerManager)
    manager.stat_loggers = [first, _logger()]
    base = _value("specplug:fault_requests_total")
    manager.record(SchedulerStats(num_kv_fetch_reqs_by_stage={
        "waiting_to_start": 1, "specplug:fault_requests": 2}), None)
    assert seen == [{"waiting_to_start": 1}]
    assert _value("specplug:fault_requests_total") - base == 2


def test_whole_path_worker_to_metrics():
    channel, sched, log = WorkerCounters(), StubScheduler(), _logger()
    base = _value("specplug:propose_faults_total")
    for total in (1, 4):
        out = pickle.loads(pickle.dumps(_attached(channel, {"propose_faults": total})))
        log.record(_through_msgpack(sched.update_from_output(None, out)), None)
    assert _value("specplug:propose_faults_total") - base == 4


def _attached(channel: WorkerCounters, counters: dict) -> ModelRunnerOutput:
    out = _output()
    channel.attach(out, counters)
    return out
