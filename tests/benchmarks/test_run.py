"""The benchmark harness (``python -m benchmarks.run``).

Engine tests run ``--quick`` on the tiny model (one suite, batch 2, so two
worker processes: ``none`` and ``pld``); the rest are unit tests of the
harness' parts.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, run, suites

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *extra: str, env: dict | None = None):
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--methods", "none,pld",
           "--suites", "specbench", "--batch", "2", "--dtype", "float32",
           "--out", str(out), "--plot", str(tmp_path / "results.png"),
           "--log-dir", str(tmp_path / "logs"), "--timeout", "600", *extra]
    full_env = {k: v for k, v in os.environ.items() if k != run.CORRUPT_ENV}
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=900)
    doc = json.loads(out.read_text()) if out.is_file() else None
    return proc, doc


def _record(doc, method):
    hits = [r for r in doc["records"] if r["method"] == method]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_quick_run_float32_is_lossless_and_valid(tmp_path):
    # The tiny model is random: the cost-aware budget may rightly cut every
    # tree to nothing, and this test checks the draft records: pin the size.
    proc, doc = _bench(tmp_path, "--method-options", '{"pld": {"cost_aware": false}}',
                       "--repeats", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert doc is not None
    assert report.validate(doc) == []
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, report.load_schema())

    meta = doc["run"]
    assert meta["complete"] and meta["exit_code"] == 0 and meta["quick"]
    assert meta["dtype"] == "float32" and meta["lossless_check"] == "strict"
    assert meta["total_seconds"] > 0 and meta["finished_at"]
    assert meta["versions"]["vllm"].startswith("0.32")
    assert meta["corrupt_hook"] is None
    assert meta["enforce_eager"] is False  # the compiled model, as users run it
    assert meta["machine"]["cpu_flags"] and meta["machine"]["model_name"]
    assert meta["repeats"] == 2
    none, pld = _record(doc, "none"), _record(doc, "pld")
    for r in (none, pld):  # two timed generates; the upper median counts
        assert len(r["wall_seconds_repeats"]) == 2
        assert r["wall_seconds"] == max(r["wall_seconds_repeats"])
    for r in (none, pld):
        assert r["status"] == "ok" and r["suite"] == "specbench" and r["batch_size"] == 2
        assert r["num_prompts"] == 2 and r["generated_tokens"] == 2 * 32  # ignore_eos
        assert r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0
        assert r["identical"] is True and r["token_match_rate"] == 1.0
        assert r["self_repetition"] >= 1 and r["self_repetition_with_prompt"] >= 1
        assert r["engine_compile"] in ("compiled", "loaded")
    assert none["speedup"] == pytest.approx(1.0) and none["tau"] == 1.0
    # tau from the record's own counters: 64 tokens over 64 - accepted passes
    assert pld["tau"] == pytest.approx(64 / (64 - pld["accepted_tokens"]))
    assert pld["draft_rate"] == pytest.approx(pld["drafts"] / (64 - pld["accepted_tokens"]))
    assert none["mean_accepted_length"] is None and none["proposer_time_share"] is None
    assert pld["speedup"] > 0 and pld["mean_accepted_length"] >= 1.0
    assert pld["drafts"] > 0 and len(pld["acceptance_per_position"]) == 8
    assert 0 <= pld["proposer_time_share"] < 1
    assert pld["specplug_stats"]["drafts"] == pld["drafts"]
    assert [c["suite"] for c in doc["ceilings"]] == ["specbench"]
    md = report.markdown(doc).splitlines()
    assert md[2] == "| method | specbench | identical |"
    pld_row = next(line for line in md if line.startswith("| pld |"))
    assert pld_row.endswith("| yes |") and f"/ {pld['mean_accepted_length']:.2f}" in pld_row
    assert pld_row.startswith(f"| pld | {pld['tau']:.2f} / ")
    assert any(line.startswith("| *ceiling*") for line in md)
    # Human-readable table and progress on stdout, and the plot.
    assert "== batch size 2 ==" in proc.stdout and "pld (specplug) batch=2" in proc.stdout
    if report_has_matplotlib():
        assert (tmp_path / "results.png").stat().st_size > 0


@pytest.mark.engine
@pytest.mark.slow  # test_group_turns_and_plan_groups checks the turn order without engines
@pytest.mark.timeout(600)
def test_paired_run_times_the_two_engines_in_turn(tmp_path):
    """``--paired``: plain decoding's engine is up beside the method's and
    each timed generate of one is next to the other's, first one then the
    other going first, never at once (checked
    on the workers' own wall-clock spans); the speedup is the median of the
    side-by-side ratios (worked out here from the recorded wall times).
    ``--pair-chunk 1``: a suite's 2 prompts go in two timed calls each, so
    2 repeats are 4 calls per engine, and a repeat's wall time is the sum of
    its two calls."""
    proc, doc = _bench(tmp_path, "--method-options", '{"pld": {"cost_aware": false}}',
                       "--repeats", "2", "--paired", "--pair-chunk", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report.validate(doc) == []
    assert doc["run"]["paired"] is True
    none, pld = _record(doc, "none"), _record(doc, "pld")
    assert none.get("paired_speedup_repeats") is None  # none runs alone, as before
    assert pld["identical"] is True
    base = pld["paired_baseline_wall_seconds"]
    mine = pld["wall_seconds_repeats"]
    assert len(base) == len(mine) == 2
    # same tokens (greedy, ignore_eos): each ratio is base wall / own wall
    ratios = sorted(b / w for b, w in zip(base, mine))
    assert pld["paired_speedup_repeats"] == pytest.approx(ratios)
    assert pld["speedup"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert pld["speedup_unpaired"] == pytest.approx(none["wall_seconds"] / pld["wall_seconds"])
    logs = tmp_path / "logs"
    spans = []
    for tag, path in (("base", next(logs.glob("*_pld_b2_base.result.json"))),
                      ("pld", next(logs.glob("*_pld_b2.result.json")))):
        spans += [(x[0], x[1], tag) for e in json.loads(path.read_text())["suites"]
                  for x in e["timed_spans"]]
    spans.sort()
    # in turn, call by call, who goes first alternating (ABBA)
    assert [t for _, _, t in spans] == ["base", "pld", "pld", "base"] * 2
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # never at once


@pytest.mark.engine
@pytest.mark.slow  # test_group_turns_and_plan_groups checks the turn order without engines
@pytest.mark.timeout(900)
def test_pair_group_times_several_methods_beside_one_baseline(tmp_path):
    """``--pair-group 2``: `pld` and `suffix_tree` share one plain-decoding
    engine, the three timed in turn, never at once. `suffix_tree` remembers
    earlier outputs, so it is timed once per suite and sits out the second
    repeat. Expected order worked out by hand: one suite of 2 prompts in
    calls of 1 (--pair-chunk 1), 2 repeats; forward on even calls,
    backward on odd ones."""
    proc, doc = _bench(tmp_path, "--methods", "none,pld,suffix_tree",
                       "--method-options",
                       '{"pld": {"cost_aware": false}, "suffix_tree": {"cost_aware": false}}',
                       "--repeats", "2", "--paired", "--pair-chunk", "1", "--pair-group", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report.validate(doc) == []
    assert doc["run"]["pair_group"] == 2
    pld, st = _record(doc, "pld"), _record(doc, "suffix_tree")
    assert pld["identical"] is True and st["identical"] is True
    # one baseline for both: the same wall times in both records
    assert pld["paired_baseline_wall_seconds"] == st["paired_baseline_wall_seconds"]
    base = pld["paired_baseline_wall_seconds"]
    assert len(base) == 2 and len(pld["wall_seconds_repeats"]) == 2
    assert st["wall_seconds_repeats"] is None and st["speedup_from"] == "first repeat"
    assert st["speedup"] == pytest.approx(base[0] / st["wall_seconds"])
    logs = tmp_path / "logs"
    assert len(list(logs.glob("*_base.result.json"))) == 1
    spans = []
    for tag, pattern in (("base", "*_pld_b2_base.result.json"), ("pld", "*_pld_b2.result.json"),
                         ("st", "*_suffix_tree_b2.result.json")):
        spans += [(x[0], x[1], tag) for e in json.loads(next(logs.glob(pattern)).read_text())
                  ["suites"] for x in e["timed_spans"]]
    spans.sort()
    assert [t for _, _, t in spans] == ["base", "pld", "st", "st", "pld", "base",
                                        "base", "pld", "pld", "base"]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # never at once


def test_group_turns_and_plan_groups():
    class S:  # a suite: only its prompt count matters
        def __init__(self, n):
            self.prompts = [[1]] * n

    # two suites (3 prompts in calls of 2: 2 calls; 1 prompt: 1 call), 2
    # repeats; worker 2 times once. Even calls forward, odd ones backward.
    assert run.group_turns([S(3), S(1)], 2, [2, 2, 1]) == [
        [0, 1, 2], [2, 1, 0],  # suite 1, repeat 1
        [0, 1], [1, 0],        # suite 1, repeat 2
        [0, 1, 2],             # suite 2, repeat 1
        [1, 0]]                # suite 2, repeat 2
    assert run.group_turns([S(2)], 0, [1, 1]) == [[0, 1]]  # 0: a whole suite per call

    def m(name, skip=None):
        return {"name": name, "skip": skip}

    ms = [m("none"), m("a"), m("b"), m("c", skip="no head"), m("d"), m("e"), m("f")]
    configs = [(b, x) for b in (1, 8) for x in ms]
    # none and skipped methods alone; groups never cross a batch size
    assert run.plan_groups(configs, True, 2) == [
        [0], [1, 2], [3], [4, 5], [6], [7], [8, 9], [10], [11, 12], [13]]
    assert run.plan_groups(configs, False, 2) == [[i] for i in range(14)]
    assert run.plan_groups(configs, True, 1) == [[i] for i in range(14)]


def test_a_method_that_remembers_outputs_is_timed_once():
    suffix = {"name": "suffix", "kind": "vllm", "options": {}}
    pld = {"name": "pld", "kind": "specplug", "options": {}}
    assert run.worker_repeats(suffix, 3) == 1 and run.worker_repeats(pld, 3) == 3
    assert run.worker_repeats(suffix, 1) == 1
    # timed once beside a baseline timed three times: against its first call
    entry = {"wall_seconds": 2.0, "wall_seconds_repeats": None, "generated_tokens": 100,
             "outputs": [[1, 2]], "specplug_stats": None,
             "counters": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                          "accepted_tokens_per_pos": []},
             "paired_baseline": {"wall_seconds_repeats": [3.0, 1.0, 1.0],
                                 "generated_tokens": 100}}
    base = {"wall_seconds": 1.0, "wall_seconds_repeats": [3.0, 1.0, 1.0],
            "generated_tokens": 100, "outputs": [[1, 2]]}
    rec = run.build_record(suffix, "s", 8, {}, entry, base, None, 1, None, False)
    assert rec["speedup"] == 1.5 and rec["speedup_from"] == "first repeat"
    assert rec["paired_speedup_repeats"] == [1.5] and rec["speedup_unpaired"] == 0.5
    # unpaired: against the baseline's median, still its only run counted
    del entry["paired_baseline"]
    rec = run.build_record(suffix, "s", 8, {}, entry, base, None, 1, None, False)
    assert rec["speedup"] == 0.5 and rec["speedup_from"] == "first repeat"
    # a run without repeats says nothing
    rec = run.build_record(suffix, "s", 8, {}, entry, {**base, "wall_seconds_repeats": None},
                           None, 1, None, False)
    assert rec["speedup_from"] is None


def _stopped(pid: int, want: bool) -> bool:
    """Whether ``pid`` reaches the wanted stopped state within 2 s (a signal
    is delivered asynchronously). /proc/<pid>/stat: "pid (comm) STATE ..."."""
    import time

    for _ in range(200):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if (state == "T") == want:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_hold_stops_and_resumes_a_paired_workers_whole_group():
    """``--paired`` stops the waiting engine's process group (the worker and
    anything it started) while the other is timed, and resumes it after."""
    proc = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys, time; "
                             "c = subprocess.Popen(['sleep', '30']); "
                             "print(c.pid, flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        run._hold(proc, stop=True)
        assert _stopped(proc.pid, True) and _stopped(child, True)
        run._hold(proc, stop=False)
        assert _stopped(proc.pid, False) and _stopped(child, False)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    run._hold(proc, stop=True)  # a worker already gone is not an error


def report_has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


@pytest.mark.slow  # default-suite time budget (30 min)
@pytest.mark.engine
@pytest.mark.timeout(600)
def test_corrupt_hook_is_reported_as_lossy(tmp_path):
    proc, doc = _bench(tmp_path, env={run.CORRUPT_ENV: "pld"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LOSSY" in proc.stdout and "NOT token-identical" in proc.stdout
    assert report.validate(doc) == []
    assert doc["run"]["corrupt_hook"] == "pld" and doc["run"]["exit_code"] == 1
    none, pld = _record(doc, "none"), _record(doc, "pld")
    assert none["identical"] is True
    assert pld["status"] == "ok" and pld["identical"] is False
    assert pld["identical_fraction"] == 0.5
    assert pld["token_match_rate"] == pytest.approx((16 + 32) / 64)
    assert pld["mismatches"] == [{"prompt_index": 0, "first_divergence": 16,
                                  "reference_length": 32, "length": 32}]


# ------------------------------------------------------------------ units
def test_compare_and_corrupt():
    ref = [[1, 2, 3, 4], [5, 6]]
    assert run.compare(ref, [list(r) for r in ref])["identical"] is True
    got = run.corrupt(ref)
    assert ref == [[1, 2, 3, 4], [5, 6]]  # not in place
    c = run.compare(ref, got)
    assert c["identical"] is False and c["identical_fraction"] == 0.5
    assert c["token_match_rate"] == 4 / 6
    assert c["mismatches"] == [{"prompt_index": 0, "first_divergence": 2,
                                "reference_length": 4, "length": 4}]


def test_worker_timeout_is_an_error(tmp_path):
    job = {"model": "/nonexistent", "dtype": "float32", "max_model_len": 64,
           "batch_size": 1, "seed": 0, "kv_cache_bytes": None, "spec": None,
           "kind": "baseline", "max_tokens": 4, "ignore_eos": True, "warmup_prompts": [],
           "suites": [], "result_path": str(tmp_path / "r.json")}
    events = []
    res = run.run_config(job, tmp_path / "w.log", 0.5, events.append)
    assert res["status"] == "error" and "timed out" in res["reason"]
    assert not (tmp_path / "r.json").exists()


def test_preflight_skips_what_cannot_run_here():
    assert run.preflight("none", "baseline", {}) is None
    assert run.preflight("pld", "specplug", {"tree_branches": 3}) is None
    assert "datastore" in run.preflight("dresd", "specplug", {})
    assert "tree_branches" in run.preflight("pld", "specplug", {"tree_branches": 0})
    assert "model" in run.preflight("eagle3", "vllm", {})
    assert run.preflight("eagle3", "vllm", {"model": "/some/head"}) is None
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        assert "arctic-inference" in run.preflight("suffix", "vllm", {})
    assert run.method_kind("pld") == "specplug"
    assert run.method_kind("ngram") == "vllm" and run.method_kind("none") == "baseline"


def test_parse_args_defaults_and_options(tmp_path):
    a = run.parse_args(["--quick"])
    assert a.method_names == ["none", "pld"] and a.batch_sizes == [1, 2]
    assert a.dtype == "float32" and a.limit == 2 and a.max_tokens == 32 and a.ignore_eos
    a = run.parse_args([])
    assert a.dtype == "bfloat16" and a.batch_sizes == [1, 8] and a.max_tokens == 256
    assert a.method_names[0] == "none" and "dresd" in a.method_names
    f = tmp_path / "opts.json"
    f.write_text('{"pld": {"tree_branches": 3}}')
    a = run.parse_args(["--methods", "pld", "--method-options", f"@{f}"])
    assert a.method_names == ["none", "pld"] and a.added_none
    assert run.spec_config("pld", a) == {"method": "pld", "num_speculative_tokens": 8,
                                         "tree_branches": 3}
    assert run.spec_config("none", a) is None
    with pytest.raises(SystemExit):
        run.parse_args(["--method-options", "[1]"])


def test_suites(tmp_path, monkeypatch):
    spec = suites.load("specbench")
    assert len(spec.texts) == 480
    # Round-robin over the six categories.
    rag = suites.load("specbench:rag")
    assert len(rag.texts) == 80 and rag.name == "specbench:rag"
    assert len(suites.load("specbench:mt_bench").texts) == 80
    assert len(suites.load("specbench:coding").texts) == 10
    with pytest.raises(ValueError):
        suites.load("specbench:nope")
    with pytest.raises(ValueError):
        suites.load("nosuchsuite")
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "a"}\n{"turns": ["b", "c"]}\n\n{"text": "d"}\n')
    mine = suites.load(str(f))
    assert mine.name == "mine" and mine.texts == ["a", "b", "d"]
    with pytest.raises(suites.SuiteUnavailable):
        suites.load(str(tmp_path / "missing.jsonl"))
    monkeypatch.setenv("SPECPLUG_SHARED", str(tmp_path))
    with pytest.raises(suites.SuiteUnavailable):
        suites.load("specbench")


def test_specbench_limit_is_stratified():
    import json as _json

    rows = [_json.loads(line) for line in
            (suites.shared_dir() / "data/spec_bench/question.jsonl").read_text().splitlines()]
    by_text = {r["turns"][0]: suites.specbench_category(r) for r in rows}
    first = suites.load("specbench").texts[:12]
    cats = [by_text[t] for t in first]
    assert sorted(set(cats)) == sorted(suites.SPECBENCH_CATEGORIES)
    assert all(cats.count(c) == 2 for c in set(cats))


def test_tokenize_chat_template_and_limit(tiny_model):
    from transformers import AutoTokenizer

    from vllm_specplug.corpus import chat_ids

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = chat_ids(tok, "hi")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    s = suites.Suite("x", "mem", ["short", "x" * 5000, "also short", "third"])
    suites.tokenize(s, tok, limit=2, max_prompt_len=200)
    assert len(s.prompts) == 2 and s.dropped_too_long == 1


def test_schema_accepts_skipped_records_and_table():
    rec = {k: None for k in report.load_schema()["$defs"]["record"]["required"]}
    rec.update(method="eagle3", method_kind="vllm", method_options={}, suite="gsm8k",
               batch_size=1, status="skipped", reason="needs a head", num_prompts=3,
               mismatches=[])
    doc = {"schema_version": 1, "ceilings": [], "records": [rec], "run": {
        "command": "x", "started_at": "2025-01-01T00:00:00+00:00", "finished_at": None,
        "total_seconds": None, "complete": False, "exit_code": None, "model": "m",
        "dtype": "bfloat16", "max_tokens": 8, "max_model_len": 64,
        "num_speculative_tokens": 8, "batch_sizes": [1], "limit": None, "quick": False,
        "ignore_eos": False, "temperature": 0.0, "seed": 0, "batching": "max_num_seqs",
        "lossless_check": "report", "methods": [], "suites": [], "machine": {
            "hostname": "h", "platform": "p", "processor": "c", "cpu_count": 2,
            "python": "3"}, "versions": {"vllm": None, "torch": None,
                                          "transformers": None, "vllm_specplug": None},
        "git": None, "env": {}, "kv_cache_bytes": None, "corrupt_hook": None,
        "log_dir": "/tmp"}}
    doc["run"]["methods"] = [{"name": "eagle3", "kind": "vllm", "options": {},
                              "speculative_config": {"method": "eagle3"},
                              "skipped_reason": "needs a head"}]
    assert report.validate(doc) == []
    assert "SKIPPED" in report.table(doc)
    assert "| eagle3 | skipped | - |" in report.markdown(doc)
    rec["reason"] = None  # a non-ok record must say why
    assert report.validate(doc)


def test_labelled_variants_and_default_eagle3_head(ref_model, tiny_model):
    assert run.method_kind("pld@tree") == "specplug"
    assert "tree_branches" in run.preflight("pld@tree", "specplug", {"tree_branches": 0})
    args = run.parse_args(["--methods", "pld,pld@tree",
                           "--method-options", '{"pld@tree": {"tree_branches": 3}}'])
    assert args.method_names == ["none", "pld", "pld@tree"]
    spec = run.spec_config("pld@tree", args)
    assert spec["method"] == "pld" and spec["tree_branches"] == 3
    assert "tree_branches" not in run.spec_config("pld", args)
    # a plain-decoding label takes engine options, not a speculative config
    args = run.parse_args(["--methods", "none@sync", "--method-options",
                           '{"none@sync": {"async_scheduling": false}}'])
    assert run.method_kind("none@sync") == "baseline"
    assert run.spec_config("none@sync", args) is None
    assert run.preflight("none@sync", "baseline", {"async_scheduling": False}) is None
    assert "async_scheduling" in run.preflight("none@sync", "baseline", {"max_num_seqs": 2})
    # the shipped head stands in for "model" on the reference model only
    assert run.preflight("eagle3", "vllm", {}, ref_model) is None
    assert "model" in run.preflight("eagle3", "vllm", {}, tiny_model)


def test_adjacency_cost_runs():
    from benchmarks.studies import adjacency_cost

    out = adjacency_cost.main(["--vocab", "512", "--repeats", "5"])
    assert out["update_rows"] == 72 and out["update"]["median_ms"] > 0
    assert out["expand"]["p90_ms"] >= out["expand"]["median_ms"]


def test_repeats_count_only_the_first_run_of_a_method_that_remembers_outputs():
    # three timed calls of one suite beside plain decoding's three; the second
    # and third twice as fast, as a method that drafts from its memory of the
    # first run's answers would be
    walls, base_walls = [2.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    entry = {"wall_seconds": 1.0, "wall_seconds_repeats": walls, "generated_tokens": 100,
             "outputs": [[1, 2]], "specplug_stats": None,
             "counters": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                          "accepted_tokens_per_pos": []},
             "paired_baseline": {"wall_seconds_repeats": base_walls, "generated_tokens": 100}}
    base = {"wall_seconds": 2.0, "generated_tokens": 100, "outputs": [[1, 2]]}

    def record(name):
        method = {"name": name, "kind": run.method_kind(name), "options": {}}
        return run.build_record(method, "s", 8, {}, entry, base, None, 1, None, False)

    assert [run.remembers_outputs(m) for m in ("none", "ngram", "suffix", "eagle3")] == \
        [False, False, True, False]
    remembers = {m for m in ("pld", "suffix_tree", "recycle", "adapld", "dresd", "eagle3_tree",
                             "graft", "respec", "reader") if run.remembers_outputs(m)}
    assert remembers == {"suffix_tree", "recycle", "graft"}
    pld, st, sfx = record("pld"), record("suffix_tree"), record("suffix")
    # the median of the pairs' ratios (1, 2, 2) for a method without memory
    assert pld["speedup"] == 2.0 and pld["speedup_from"] is None and pld["wall_seconds"] == 1.0
    for rec in (st, sfx):  # the first pair only
        assert rec["speedup"] == 1.0 and rec["speedup_from"] == "first repeat"
        assert rec["wall_seconds"] == 2.0 and rec["tokens_per_s"] == 50.0
        assert rec["paired_speedup_repeats"] == [1.0] and rec["speedup_unpaired"] == 1.0
