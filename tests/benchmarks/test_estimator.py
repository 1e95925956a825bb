"""The one estimator of ``benchmarks.run``: per-pass ratios, their median,
min and max; speculation and kernel speedups against ``plain`` in the same
run; a method that remembers outputs measured over fresh-engine passes.
Hand-made worker results, no engine."""

from __future__ import annotations

import pytest

from benchmarks import run

COUNTERS = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_tokens_per_pos": []}


def _entry(walls, outputs=((1, 2),), base_walls=None, toks=100):
    entry = {"name": "s", "wall_seconds": walls[0], "generated_tokens": toks,
             "wall_seconds_repeats": list(walls) if len(walls) > 1 else None,
             "outputs": [list(o) for o in outputs], "specplug_stats": None,
             "counters": dict(COUNTERS)}
    if base_walls is not None:
        entry["paired_baseline"] = {"wall_seconds_repeats": list(base_walls),
                                    "generated_tokens": toks}
    return entry


def _method(name):
    return {"name": name, "kind": run.method_kind(name), "options": {}}


def _record(name, entry, base, result=None):
    return run.build_record(_method(name), "s", 1, result or {}, entry, base, None, 1,
                            None, False)


BASE = _entry([2.0, 2.0, 2.0])


def test_every_cell_is_the_median_of_its_passes_with_min_and_max():
    # unpaired: each pass over the baseline's pass of the same index
    rec = _record("pld", _entry([1.0, 2.0, 0.5]), _entry([2.0, 2.0, 4.0]))
    assert rec["speedup_repeats"] == [2.0, 1.0, 8.0]
    assert (rec["speedup"], rec["speedup_min"], rec["speedup_max"]) == (2.0, 1.0, 8.0)
    assert rec["passes"] == 3 and rec["wall_seconds"] == 1.0
    assert rec["tokens_per_s"] == 100.0
    # paired: against the baseline's calls timed beside it
    rec = _record("pld", _entry([1.0, 1.0, 2.0], base_walls=[3.0, 1.0, 2.0]), BASE)
    assert rec["paired_speedup_repeats"] == [3.0, 1.0, 1.0] and rec["speedup"] == 1.0
    assert rec["speedup_unpaired"] == 2.0  # against the baseline engine's own passes
    # one pass: the figure itself, min = max
    rec = _record("pld", _entry([4.0]), _entry([2.0]))
    assert (rec["speedup"], rec["speedup_min"], rec["speedup_max"], rec["passes"]) == \
        (0.5, 0.5, 0.5, 1)
    assert "speedup_from" not in rec


def test_speculation_and_kernel_speedups_against_plain_in_the_same_run():
    none = _record("none", BASE, BASE)
    plain = _record("plain", _entry([1.6, 2.0, 1.0]), BASE)  # 1.25, 1.0, 2.0
    pld = _record("pld", _entry([1.0, 0.5, 1.0]), BASE)      # 2.0, 4.0, 2.0
    ngram = _record("ngram", _entry([1.0, 4.0, 0.5]), BASE)  # 2.0, 0.5, 4.0
    missing = {**_record("pld", _entry([1.0]), BASE), "suite": "other"}
    records = [none, plain, pld, ngram, missing]
    run.annotate_speedups(records)
    assert none["speculation_speedup"] is None and none["kernel_speedup"] is None
    assert plain["speculation_speedup"] == 1.0 and plain["kernel_speedup"] == 1.25
    # per pass: 2.0 / 1.25, 4.0 / 1.0, 2.0 / 2.0
    assert pld["speculation_speedup"] == pytest.approx(1.6)
    assert pld["speculation_speedup_min"] == pytest.approx(1.0)
    assert pld["speculation_speedup_max"] == pytest.approx(4.0)
    assert (pld["kernel_speedup"], pld["kernel_speedup_min"], pld["kernel_speedup_max"]) == \
        (1.25, 1.0, 2.0)
    assert pld["speedup"] == 2.0  # still against stock vLLM
    # vLLM's own methods run stock: speculation is their whole speedup
    assert (ngram["speculation_speedup"], ngram["speculation_speedup_min"],
            ngram["speculation_speedup_max"], ngram["kernel_speedup"]) == (2.0, 0.5, 4.0, None)
    # no plain on that suite: nothing to measure speculation against
    assert missing["speculation_speedup"] is None and missing["kernel_speedup"] is None


def test_plain_is_added_beside_specplug_methods_only():
    assert run.with_baselines(["ngram", "suffix"]) == (["none", "ngram", "suffix"], False)
    assert run.with_baselines(["pld", "ngram"]) == (["none", "plain", "pld", "ngram"], True)
    assert run.with_baselines(["pld", "plain", "none"]) == (["none", "plain", "pld"], False)
    assert run.with_baselines(["plain"]) == (["none", "plain"], False)


def test_a_method_that_remembers_outputs_gets_a_fresh_engine_per_pass():
    assert [run.remembers_outputs(m) for m in ("none", "ngram", "suffix", "eagle3")] == \
        [False, False, True, False]
    remembers = {m for m in ("pld", "suffix_tree", "recycle", "adapld", "dresd", "eagle3_tree",
                             "graft", "respec", "reader", "plain") if run.remembers_outputs(m)}
    assert remembers == {"suffix_tree", "recycle", "graft"}
    pld = {**_method("pld"), "skip": None}
    sfx = {**_method("suffix"), "skip": None}
    skipped = {**_method("recycle"), "skip": "no"}
    out = run.expand_passes([pld, sfx, skipped], 3)
    assert [(m["name"], m.get("pass_index")) for m in out] == [
        ("pld", None), ("suffix", 0), ("suffix", 1), ("suffix", 2), ("recycle", None)]
    assert [run.worker_repeats(m, 3) for m in out] == [3, 1, 1, 1, 3]
    assert [run.timed_passes(m, 3) for m in out[:3]] == [[0, 1, 2], [0], [1]]
    assert run.expand_passes([sfx], 1) == [sfx]  # one pass: one engine


def test_fresh_engine_passes_merge_into_one_cell():
    # pass k timed once, beside the baseline's pass k of its group
    passes = [{"status": "ok", "reason": None, "peak_memory_mib": m,
               "suites": [_entry([w], outputs=[out], base_walls=[2.0, 4.0, 1.0])]}
              for m, w, out in ((10.0, 1.0, (1, 2)), (30.0, 2.0, (1, 2)), (20.0, 0.5, (1, 2)))]
    merged = run.merge_passes(passes)
    assert merged["status"] == "ok" and merged["fresh_engine_per_pass"]
    assert merged["peak_memory_mib"] == 30.0
    (entry,) = merged["suites"]
    assert entry["wall_seconds_repeats"] == [1.0, 2.0, 0.5] and entry["wall_seconds"] == 1.0
    assert entry["paired_baseline"]["wall_seconds_repeats"] == [2.0, 4.0, 1.0]
    rec = _record("suffix", entry, BASE, merged)
    assert rec["paired_speedup_repeats"] == [2.0, 2.0, 2.0] and rec["passes"] == 3
    assert rec["fresh_engine_per_pass"] is True and rec["identical"] is True
    # a later pass that differs from plain decoding makes the cell lossy
    passes[2]["suites"][0]["outputs"] = [[1, 3]]
    rec = _record("suffix", run.merge_passes(passes)["suites"][0], BASE, merged)
    assert rec["identical"] is False
    # a failed pass fails the cell, saying which
    passes[1].update(status="error", reason="boom", suites=[])
    merged = run.merge_passes(passes)
    assert merged["status"] == "error" and merged["reason"] == "pass 2: boom"
    assert merged["suites"] == []


def test_fresh_engine_passes_give_tau_from_every_pass():
    # 100 tokens each; accepted 20, 50 and 80: taus 1.25, 2 and 5, pooled
    # 100 / (100 - 50) = 2 (not pass 1's 1.25)
    def one(accepted, drafts):
        entry = _entry([1.0])
        entry["counters"] = {"drafts": drafts, "draft_tokens": 2 * drafts,
                             "accepted_tokens": accepted,
                             "accepted_tokens_per_pos": [accepted, 0]}
        return {"status": "ok", "reason": None, "suites": [entry]}

    merged = run.merge_passes([one(20, 40), one(50, 40), one(80, 45)])
    rec = _record("suffix", merged["suites"][0], BASE, merged)
    assert rec["tau"] == pytest.approx(2.0)
    assert rec["tau_repeats"] == pytest.approx([1.25, 2.0, 5.0])
    assert (rec["drafts"], rec["draft_tokens"], rec["accepted_tokens"]) == (42, 83, 50)
    assert rec["mean_accepted_length"] == pytest.approx(1 + 50 / (125 / 3))
    assert rec["acceptance_per_position"] == pytest.approx([50 / (125 / 3), 0.0])


def test_fresh_engine_passes_keep_every_pass_gate():
    # the record's specplug_stats is pass 1's; a gate that stayed shut in
    # pass 3 shows in gate_repeats
    def one(gated, log):
        entry = _entry([1.0])
        entry["specplug_stats"] = {"drafts": 5, "budget": {
            "steps": 100, "gated_steps": gated, "explore_steps": 1, "gate_closings": len(log),
            "gate_log": log, "draft_ms": 4.0}}
        return {"status": "ok", "reason": None, "suites": [entry]}

    shut = [[20, 0, 1, 2, 1.0, 2.0, 5.0, -6.0, -1.0, 0, 2]]
    merged = run.merge_passes([one(0, []), one(2, []), one(80, shut)])
    rec = _record("suffix", merged["suites"][0], BASE, merged)
    assert [g["gated_steps"] for g in rec["gate_repeats"]] == [0, 2, 80]
    assert rec["gate_repeats"][2] == {"steps": 100, "gated_steps": 80, "explore_steps": 1,
                                      "gate_closings": 1, "gate_log": shut}
