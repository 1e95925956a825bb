"""Per-suite deltas of the specplug stats the benchmark worker records."""

from benchmarks.worker import _stats_delta


def _adapld_stats(attempts, lexical, semantic, mem):
    from vllm_specplug.methods.adapld import AdaPLDProposer, _COUNTERS

    c = dict.fromkeys(_COUNTERS, 0)
    c.update(retrieval_attempts=attempts, lexical_hits=lexical, semantic_hits=semantic,
             no_hits=attempts - lexical - semantic)
    return {"drafts": attempts, "accepted_tokens": lexical,
            "method": {**c, "memory_bytes": mem, "live_memories": 1,
                       **AdaPLDProposer.rates(c)}}


def test_method_rates_are_recomputed_from_counter_differences():
    before = _adapld_stats(100, 90, 5, 1000)
    after = _adapld_stats(300, 110, 105, 400)
    d = _stats_delta(before, after, "adapld")
    m = d["method"]
    assert m["retrieval_attempts"] == 200 and m["lexical_hits"] == 20
    assert m["lexical_hit_rate"] == 0.1  # 20 / 200, not 110/300 - 90/100
    assert m["semantic_recovery"] == 100 / 180
    assert m["memory_bytes"] == 400  # a level, as of the end
    assert d["mean_accepted_length"] == 1 + 20 / 200


def test_unknown_method_keeps_levels_and_drops_float_differences():
    before = {"method": {"n": 1, "rate": 0.5, "query": {"n": 3}}}
    after = {"method": {"n": 4, "rate": 0.7, "query": {"n": 9}}}
    m = _stats_delta(before, after, "ngram")["method"]
    assert m == {"n": 3, "query": {"n": 9}}
