"""Per-suite deltas of the specplug stats the benchmark worker records."""

from benchmarks.worker import _stats_delta


def _adapld_stats(attempts, lexical, semantic, mem):
    from vllm_specplug.engine.interface import ProposerStats
    from vllm_specplug.methods.adapld import AdaPLDProposer, _COUNTERS

    c = dict.fromkeys(_COUNTERS, 0)
    c.update(retrieval_attempts=attempts, lexical_hits=lexical, semantic_hits=semantic,
             no_hits=attempts - lexical - semantic)
    own = ProposerStats(counters=c, gauges={"memory_bytes": mem, "live_memories": 1})
    # What the runner's specplug_stats() returns for it (Proposer.report).
    flat = {**own.counters, **own.gauges, **AdaPLDProposer.rates(own.counters)}
    return {"drafts": attempts, "accepted_tokens": lexical,
            "method": flat, "method_counters": sorted(c)}


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


def test_declared_counters_are_subtracted_everything_else_kept():
    before = {"method": {"n": 1, "size": 7, "query": {"n": 3}}, "method_counters": ["n"]}
    after = {"method": {"n": 4, "size": 5, "query": {"n": 9}}, "method_counters": ["n"]}
    m = _stats_delta(before, after, "ngram")["method"]
    assert m == {"n": 3, "size": 5, "query": {"n": 9}}


def test_latency_summaries_are_over_the_suite_alone():
    """A proposer's timing summary (``RunningStat.as_ms``) at the suite's
    end includes the engine's warm-up: its count, total and mean are taken
    from the differences, and the maximum says it is the engine's."""
    from vllm_specplug.engine.stats import RunningStat

    timer = RunningStat()
    for seconds in (5.0, 0.002):  # a warm-up's first call, then a usual one
        timer.add(seconds)
    before = {"method": {"extend": timer.as_ms(), "draft": {"n": 0}}, "method_counters": []}
    for seconds in (0.001, 0.003):
        timer.add(seconds)
    after = {"method": {"extend": timer.as_ms(), "draft": {"n": 0}}, "method_counters": []}
    m = _stats_delta(before, after, "eagle3_tree")["method"]
    assert m["extend"]["n"] == 2 and abs(m["extend"]["mean_ms"] - 2.0) < 1e-9
    assert abs(m["extend"]["total_s"] - 0.004) < 1e-12
    assert m["extend"]["engine_max_ms"] == 5000.0 and "max_ms" not in m["extend"]
    assert m["draft"] == {"n": 0, "total_s": 0.0, "mean_ms": None}


def test_budget_counters_are_per_suite_estimates_as_of_the_end():
    # the budget's stats over a suite: counters (steps, nodes, expected vs
    # realised, size histogram) as differences; the learned curve and
    # calibration are estimates, kept as they stand after the suite
    before = {"budget": {"steps": 10, "expected_accepted": 4.0, "realised_accepted": 3,
                         "size_hist": {0: 5, 3: 5}, "calibration": 0.9,
                         "step_ms_by_rows": {"1": 30.0}}}
    after = {"budget": {"steps": 25, "expected_accepted": 10.5, "realised_accepted": 8,
                        "size_hist": {0: 12, 3: 5, 4: 3}, "calibration": 0.8,
                        "step_ms_by_rows": {"1": 31.0, "4": 40.0}}}
    b = _stats_delta(before, after)["budget"]
    assert b["steps"] == 15 and b["realised_accepted"] == 5
    assert b["expected_accepted"] == 6.5
    assert b["size_hist"] == {0: 7, 4: 3}
    assert b["calibration"] == 0.8 and b["step_ms_by_rows"] == {"1": 31.0, "4": 40.0}


def test_levels_are_kept_not_subtracted():
    """How many linear layers the kernel took (and the live trees) are
    levels: a suite of a routed engine must not report 0 routed layers."""
    before = {"drafts": 5, "live_trees": 2, "cpu_linear_layers": 92}
    after = {"drafts": 9, "live_trees": 0, "cpu_linear_layers": 92}
    d = _stats_delta(before, after)
    assert d["drafts"] == 4 and d["live_trees"] == 0 and d["cpu_linear_layers"] == 92


def test_cpu_linear_state_says_which_engines_run_the_kernel(monkeypatch):
    from benchmarks.worker import cpu_linear_state

    stats = {"cpu_linear_layers": 3, "cpu_linear_shapes": {"576x1536": 2, "1536x576": 1}}
    monkeypatch.delenv("SPECPLUG_CPU_LINEAR", raising=False)
    assert cpu_linear_state("specplug", stats) == {
        "env": None, "layers": 3, "shapes": {"576x1536": 2, "1536x576": 1}}
    monkeypatch.setenv("SPECPLUG_CPU_LINEAR", "0")
    off = cpu_linear_state("specplug", {"cpu_linear_layers": 0, "cpu_linear_shapes": {}})
    assert off == {"env": "0", "layers": 0, "shapes": {}}
    # stock vLLM engines never run it
    assert cpu_linear_state("baseline", stats) is None and cpu_linear_state("vllm", None) is None
