"""Tree metrics for /metrics, from vLLM's spec-decode stats."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_specplug.metrics import SpecplugStatLogger


def _value(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_tree_series_from_spec_decode_stats():
    cfg = SimpleNamespace(additional_config={"specplug": {"method": "pld", "options": {}}})
    log = SpecplugStatLogger(cfg)
    sd = SpecDecodingStats.new(8)
    # Three trees of 5, 3 and 8 nodes accepting depths 2, 0 and 4.
    for size, depth in [(5, 2), (3, 0), (8, 4)]:
        sd.observe_draft(num_draft_tokens=size, num_accepted_tokens=depth)
    before = _value("specplug:trees_total", method="pld")
    log.record(SimpleNamespace(spec_decoding_stats=sd), None)
    assert _value("specplug:trees_total", method="pld") - before == 3
    assert _value("specplug:tree_nodes_total", method="pld") >= 16
    assert _value("specplug:accepted_depth_drafts_total", method="pld", depth="0") >= 1
    assert _value("specplug:accepted_depth_drafts_total", method="pld", depth="4") >= 1


def test_idle_without_specplug_method():
    log = SpecplugStatLogger(SimpleNamespace(additional_config={}))
    log.record(SimpleNamespace(spec_decoding_stats=None), None)
    assert log.method is None


def test_accepted_tokens_by_source_reach_a_labelled_series():
    from vllm_specplug.engine.stats import TreeStats
    from vllm_specplug.engine.tree import DraftTree
    from vllm_specplug.metrics import STATS_PREFIX, ASIDE_ATTR, worker_counters

    stats = TreeStats()
    # root -> 1 (copy4) -> 2 (copy4); root -> 3 (suffix:m8): the target produced 1, 2
    tree = DraftTree([1, 2, 3], [-1, 0, -1], sources=["copy4", "copy4", "suffix:m8"])
    stats.record_sources(tree, [1, 2])
    counters = worker_counters(stats)
    assert counters["source_accepted__copy4"] == 2
    assert counters["source_nodes__suffix_m8"] == 1
    assert "source_accepted__suffix_m8" not in counters
    cfg = SimpleNamespace(additional_config={"specplug": {"method": "auto", "options": {}}})
    log = SpecplugStatLogger(cfg)
    before = _value("specplug:source_accepted_tokens_total", method="auto", source="copy4")
    sched = SimpleNamespace(spec_decoding_stats=None, num_kv_fetch_reqs_by_stage={})
    sched.__dict__[ASIDE_ATTR] = {STATS_PREFIX + k: v for k, v in counters.items()}
    log.record(sched, None)
    assert _value("specplug:source_accepted_tokens_total", method="auto",
                  source="copy4") - before == 2
    assert _value("specplug:source_nodes_total", method="auto", source="suffix_m8") >= 1
