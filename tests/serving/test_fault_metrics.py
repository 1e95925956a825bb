"""The workers' fault counters reach the front end's /metrics through the
stats file: deltas only, a restarted worker counts from 0, files of earlier
engines are ignored."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from prometheus_client import REGISTRY

from vllm_specplug.metrics import SpecplugStatLogger, WorkerStatsFile, stats_id


def _faults() -> float:
    return REGISTRY.get_sample_value("specplug:propose_faults_total",
                                     {"method": "oracle"}) or 0.0


def test_worker_fault_counters_reach_metrics():
    sid = stats_id()
    cfg = SimpleNamespace(additional_config={"specplug": {"method": "oracle", "options": {}}})
    log = SpecplugStatLogger(cfg)
    pub = WorkerStatsFile(sid, 0)
    try:
        base = _faults()
        pub({"propose_faults": 3, "fault_requests": 5}, force=True)
        log.record(SimpleNamespace(spec_decoding_stats=None), None)
        assert _faults() - base == 3
        pub({"propose_faults": 4, "fault_requests": 6}, force=True)
        log._next_read = 0.0  # reads are throttled to once a second
        log.record(SimpleNamespace(spec_decoding_stats=None), None)
        assert _faults() - base == 4
        # Another worker process (a restart) starts again from 0.
        data = json.load(open(pub.path))
        data.update(pid=-1, propose_faults=2)
        json.dump(data, open(pub.path, "w"))
        os.utime(pub.path, (time.time() + 5, time.time() + 5))
        log._next_read = 0.0
        log.record(SimpleNamespace(spec_decoding_stats=None), None)
        assert _faults() - base == 6
    finally:
        os.remove(pub.path)


def test_stats_id_not_shared_with_a_parent(monkeypatch):
    monkeypatch.setenv("SPECPLUG_STATS_ID", "1-deadbeef")  # inherited from a parent
    assert stats_id().startswith(f"{os.getpid()}-")
