"""tau (tokens per target pass per request) and the draft rate, on hand-made
counters: every expected value below is worked out by hand in the comment
beside it, not by the code under test."""

from __future__ import annotations

import pytest

from benchmarks import report, run


def test_tau_and_draft_rate_formulas():
    # A rare drafter (vLLM's ngram with prompt_lookup_min = max = 5 on chat):
    # 128 tokens, 8 drafts that accepted 32 tokens in all.
    # passes = 128 - 32 = 96; tau = 128 / 96 = 4/3; drafts per pass = 8 / 96 = 1/12;
    # vLLM's mean accepted length = 1 + 32 / 8 = 5.
    assert report.tau(128, 32) == pytest.approx(4 / 3)
    assert report.draft_rate(8, 128, 32) == pytest.approx(1 / 12)
    # A frequent drafter: 128 tokens, 58 drafts accepting 62 tokens.
    # passes = 66; tau = 128 / 66 = 1.93939...; drafts per pass = 58 / 66 = 0.87878...
    # (mean accepted length 1 + 62 / 58 = 2.069: the lower one, yet more tokens per pass)
    assert report.tau(128, 62) == pytest.approx(1.939393, abs=1e-6)
    assert report.draft_rate(58, 128, 62) == pytest.approx(0.878787, abs=1e-6)
    # Plain decoding: one token per pass.
    assert report.tau(100, 0) == 1.0 and report.tau(100, None) == 1.0
    assert report.draft_rate(0, 100, 0) == 0.0
    # Nothing generated (or inconsistent counters): no figure rather than a division error.
    assert report.tau(0, 0) is None and report.tau(None, 3) is None
    assert report.tau(10, 10) is None and report.draft_rate(None, 10, 1) is None


def _record(method: str, kind: str, generated: int, wall: float, counters: dict | None):
    entry = {"wall_seconds": wall, "generated_tokens": generated,
             "outputs": [[1] * generated], "counters": counters, "specplug_stats": None}
    base = {"wall_seconds": 10.0, "generated_tokens": 128, "outputs": [[1] * 128]}
    m = {"name": method, "kind": kind, "options": {}}
    return run.build_record(m, "s", 1, {"status": "ok"}, entry,
                            base, None, 1, None, False)


def test_records_carry_tau_and_draft_rate():
    none = _record("none", "baseline", 128, 10.0, None)
    assert none["tau"] == 1.0 and none["draft_rate"] is None
    ngram = _record("ngram", "vllm", 128, 8.0, {
        "drafts": 8, "draft_tokens": 40, "accepted_tokens": 32,
        "accepted_tokens_per_pos": [8, 8, 8, 8, 0]})
    assert ngram["tau"] == pytest.approx(4 / 3)  # 128 / (128 - 32)
    assert ngram["draft_rate"] == pytest.approx(1 / 12)  # 8 / 96
    assert ngram["mean_accepted_length"] == 5.0  # 1 + 32 / 8
    assert ngram["speedup"] == pytest.approx(1.25)  # (128 / 8) / (128 / 10)


def _doc(records):
    return {"run": {"batch_sizes": [1], "enforce_eager": False,
                    "machine": {"processor": "AMD EPYC 7B13", "cpu_count": 2,
                                "cpus_available": 2, "isa": ["avx2", "fma"]}},
            "records": records, "ceilings": []}


def test_tables_put_tau_first():
    recs = [_record("none", "baseline", 128, 10.0, None),
            _record("ngram", "vllm", 128, 8.0, {
                "drafts": 8, "draft_tokens": 40, "accepted_tokens": 32,
                "accepted_tokens_per_pos": [8, 8, 8, 8, 0]})]
    for r in recs:
        r.update(identical=True, self_repetition=None, self_repetition_with_prompt=None)
    md = report.markdown(_doc(recs))
    # ngram: tau 1.33, 16.0 tok/s (128 / 8 s), speedup 1.25x, MAL 5.00 on 8% of passes
    assert "| ngram | 1.33 / 16.0 (1.25x) / 5.00 (8%) | yes |" in md
    assert "| none | 1.00 / 12.8 (1.00x) | yes |" in md
    assert "(compiled)" in md and "AMD EPYC 7B13" in md and "ISA: avx2 fma" in md
    text = report.table(_doc(recs))
    head = next(line for line in text.splitlines() if line.startswith("method"))
    assert head.split()[:9] == ["method", "suite", "B", "tau", "spec-x", "min-max",
                                "speedup", "kernel", "draft%"]
    row = next(line for line in text.splitlines() if line.startswith("ngram"))
    # one pass, no plain in the run: "-" for the speculation and kernel figures
    assert row.split()[3:12] == ["1.33", "-", "-", "1.25x", "-", "8.3", "1", "16.0", "5.00"]
    assert text.startswith("mode: compiled;")


def test_old_records_without_the_fields():
    """Result files written before tau existed (the README's eager runs)."""
    rec = {"status": "ok", "generated_tokens": 512, "accepted_tokens": 256, "drafts": 200}
    assert report.record_tau(rec) == 2.0  # 512 / (512 - 256)
    assert report.record_draft_rate(rec) == pytest.approx(200 / 256)
    assert report.record_tau({"status": "ok", "generated_tokens": 64,
                              "accepted_tokens": None}) == 1.0  # none
    assert report.record_tau({"status": "skipped", "generated_tokens": None}) is None
    assert report.run_mode({"run": {}}) == "eager"


def test_tau_table_against_a_reference_method():
    # Two suites; pld: 120 tokens with 40 accepted (tau 120/80 = 1.50) and
    # 100 with 50 (tau 2.00); adapld: 120 with 60 (tau 2.00 = 1.33x) and
    # 100 with 50 (2.00 = 1.00x); mean tau of adapld (2.00 + 2.00) / 2 = 2.00.
    def rec(method, suite, gen, acc):
        return {"method": method, "suite": suite, "batch_size": 1, "status": "ok",
                "generated_tokens": gen, "accepted_tokens": acc, "identical": True,
                "identical_fraction": 1.0, "token_match_rate": 1.0}

    doc = {"run": {"batch_sizes": [1], "num_speculative_tokens": 8, "enforce_eager": False},
           "records": [rec("none", "a:x", 120, 0), rec("none", "b:y", 100, 0),
                       rec("pld", "a:x", 120, 40), rec("pld", "b:y", 100, 50),
                       rec("adapld", "a:x", 120, 60), rec("adapld", "b:y", 100, 50)]}
    lines = report.tau_markdown(doc, "pld").splitlines()
    assert "| x | y | mean | identical |" in lines[2]
    assert "| pld | 1.50 | 2.00 | 1.75 | yes |" in lines
    assert "| adapld | 2.00 (1.33x) | 2.00 (1.00x) | 2.00 | yes |" in lines
    assert not any(line.startswith("| none") for line in lines)
