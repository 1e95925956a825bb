"""The benchmark harness (``python -m benchmarks.run``).

Engine tests run ``--quick`` on the tiny model (one suite, batch 2, so
three worker processes: ``none``, ``plain`` (added beside a specplug
method) and ``pld``); the rest are unit tests of the harness' parts
(the estimator's: ``test_estimator.py``).
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
    assert meta["repeats"] == 2 and meta["fresh_engine_per_pass"] == []
    none, plain, pld = _record(doc, "none"), _record(doc, "plain"), _record(doc, "pld")
    for r in (none, plain, pld):  # two timed passes: their median, min and max
        walls = r["wall_seconds_repeats"]
        assert len(walls) == 2 and r["passes"] == 2
        assert r["wall_seconds"] == pytest.approx((walls[0] + walls[1]) / 2)
        assert r["speedup_min"] == min(r["speedup_repeats"])
        assert r["speedup_max"] == max(r["speedup_repeats"])
    for r in (none, plain, pld):
        assert r["status"] == "ok" and r["suite"] == "specbench" and r["batch_size"] == 2
        assert r["num_prompts"] == 2 and r["generated_tokens"] == 2 * 32  # ignore_eos
        assert r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0
        assert r["identical"] is True and r["token_match_rate"] == 1.0
        assert r["self_repetition"] >= 1 and r["self_repetition_with_prompt"] >= 1
        assert r["engine_compile"] in ("compiled", "loaded")
    assert none["speedup"] == pytest.approx(1.0) and none["tau"] == 1.0
    assert none["speculation_speedup"] is None and none["kernel_speedup"] is None
    # plain: the plugin's engine drafting nothing, with the CPU linear kernel
    assert plain["method_kind"] == "specplug" and plain["drafts"] == 0 and plain["tau"] == 1.0
    assert plain["speculation_speedup"] == pytest.approx(1.0)
    assert plain["kernel_speedup"] == plain["speedup"]
    # pld against plain's same passes; the kernel's share is plain's speedup
    per_pass = [a / b for a, b in zip(pld["speedup_repeats"], plain["speedup_repeats"])]
    assert pld["speculation_speedup"] == pytest.approx(sum(per_pass) / 2)
    assert pld["speculation_speedup_min"] == pytest.approx(min(per_pass))
    assert pld["kernel_speedup"] == plain["speedup"]
    assert none["cpu_linear"] is None
    for r in (plain, pld):
        assert r["cpu_linear"]["env"] is None and r["cpu_linear"]["layers"] >= 0
        assert sum(r["cpu_linear"]["shapes"].values()) == r["cpu_linear"]["layers"]
    assert meta["cpu_linear"]["enabled"] is True
    assert meta["cpu_linear"]["layers"] == plain["cpu_linear"]["layers"]
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
    ratios = [b / w for b, w in zip(base, mine)]
    assert pld["paired_speedup_repeats"] == pytest.approx(ratios)
    assert pld["speedup"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    unpaired = [b / w for b, w in zip(none["wall_seconds_repeats"], mine)]
    assert pld["speedup_unpaired"] == pytest.approx((unpaired[0] + unpaired[1]) / 2)
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
    # the two warm-ups one after the other, both before the first timed call
    warm = sorted(json.loads(next(logs.glob(p)).read_text())["warmup_span"]
                  for p in ("*_pld_b2_base.result.json", "*_pld_b2.result.json"))
    assert warm[0][1] <= warm[1][0] and warm[1][1] <= spans[0][0]


@pytest.mark.engine
@pytest.mark.slow  # test_group_turns_and_plan_groups checks the turn order without engines
@pytest.mark.timeout(900)
def test_pair_group_times_fresh_engine_passes_beside_one_baseline(tmp_path):
    """``--pair-group 2`` with 2 passes: `suffix_tree` remembers earlier
    outputs, so each pass is a fresh engine; its two passes share one
    plain-decoding engine (`plain`, added, has its own), pass 1 timed beside
    the baseline's pass 1 and pass 2 beside its pass 2, never at once.
    Expected order worked out by hand: one suite of 2 prompts in calls of 1
    (--pair-chunk 1); forward on even calls, backward on odd ones."""
    proc, doc = _bench(tmp_path, "--methods", "none,suffix_tree",
                       "--method-options", '{"suffix_tree": {"cost_aware": false}}',
                       "--repeats", "2", "--paired", "--pair-chunk", "1", "--pair-group", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report.validate(doc) == []
    assert doc["run"]["fresh_engine_per_pass"] == ["suffix_tree"]
    st = _record(doc, "suffix_tree")
    assert st["identical"] is True and st["fresh_engine_per_pass"] and st["passes"] == 2
    base, mine = st["paired_baseline_wall_seconds"], st["wall_seconds_repeats"]
    assert st["paired_speedup_repeats"] == pytest.approx([b / w for b, w in zip(base, mine)])
    logs = tmp_path / "logs"
    spans = []
    for tag, pattern in (("base", "*_suffix_tree_b2_base.result.json"),
                         ("p1", "03_suffix_tree_b2.result.json"),
                         ("p2", "04_suffix_tree_b2.result.json")):
        spans += [(x[0], x[1], tag) for e in json.loads(next(logs.glob(pattern)).read_text())
                  ["suites"] for x in e["timed_spans"]]
    spans.sort()
    assert [t for _, _, t in spans] == ["base", "p1", "p1", "base", "base", "p2", "p2", "base"]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # never at once


def test_group_turns_and_plan_groups():
    class S:  # a suite: only its prompt count matters
        def __init__(self, n):
            self.prompts = [[1]] * n

    # two suites (3 prompts in calls of 2: 2 calls; 1 prompt: 1 call), 2
    # passes; worker 2 is a fresh-engine pass timing pass 1 only, worker 3
    # pass 2 only. Even calls forward, odd ones backward.
    assert run.group_turns([S(3), S(1)], 2, [[0, 1], [0, 1], [0], [1]]) == [
        [0, 1, 2], [2, 1, 0],  # suite 1, pass 1
        [0, 1, 3], [3, 1, 0],  # suite 1, pass 2
        [0, 1, 2],             # suite 2, pass 1
        [3, 1, 0]]             # suite 2, pass 2
    assert run.group_turns([S(2)], 0, [[0], [0]]) == [[0, 1]]  # 0: a whole suite per call

    def m(name, skip=None, **more):
        return {"name": name, "skip": skip, **more}

    # a method's fresh-engine passes start a group when they do not all fit
    clones = [m("s", pass_index=k, passes=3) for k in range(3)]
    configs = [(1, x) for x in [m("none"), m("a"), *clones, m("b")]]
    assert run.plan_groups(configs, True, 3) == [[0], [1], [2, 3, 4], [5]]
    assert run.plan_groups(configs, True, 4) == [[0], [1, 2, 3, 4], [5]]
    assert run.plan_groups(configs, True, 2) == [[0], [1, 2], [3, 4], [5]]  # cannot fit

    ms = [m("none"), m("a"), m("b"), m("c", skip="no head"), m("d"), m("e"), m("f")]
    configs = [(b, x) for b in (1, 8) for x in ms]
    # none and skipped methods alone; groups never cross a batch size
    assert run.plan_groups(configs, True, 2) == [
        [0], [1, 2], [3], [4, 5], [6], [7], [8, 9], [10], [11, 12], [13]]
    assert run.plan_groups(configs, False, 2) == [[i] for i in range(14)]
    assert run.plan_groups(configs, True, 1) == [[i] for i in range(14)]


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
    assert a.method_names == ["none", "plain", "pld"] and a.batch_sizes == [1, 2]
    assert a.dtype == "float32" and a.limit == 2 and a.max_tokens == 32 and a.ignore_eos
    assert a.repeats == 1 and a.added_plain
    a = run.parse_args([])
    assert a.dtype == "bfloat16" and a.batch_sizes == [1, 8] and a.max_tokens == 256
    assert a.repeats == 3
    assert a.method_names[0] == "none" and "dresd" in a.method_names
    f = tmp_path / "opts.json"
    f.write_text('{"pld": {"tree_branches": 3}}')
    a = run.parse_args(["--methods", "pld", "--method-options", f"@{f}"])
    assert a.method_names == ["none", "plain", "pld"] and a.added_none
    assert run.spec_config("pld", a) == {"method": "pld", "num_speculative_tokens": 8,
                                         "tree_branches": 3}
    assert run.spec_config("none", a) is None
    with pytest.raises(SystemExit):
        run.parse_args(["--method-options", "[1]"])


def test_code_labels_a_method_with_another_checkout(tmp_path):
    other = tmp_path / "before"
    (other / "vllm_specplug").mkdir(parents=True)
    args = run.parse_args(["--methods", "pld@before,pld", "--code", f"pld@before={other}"])
    assert args.code_dirs == {"pld@before": str(other.resolve())}
    for bad in (f"pld@after={other}", f"pld@before={tmp_path / 'missing'}", "pld@before"):
        with pytest.raises(SystemExit):
            run.parse_args(["--methods", "pld@before,pld", "--code", bad])


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
               mismatches=[], passes=0)
    doc = {"schema_version": 2, "ceilings": [], "records": [rec], "run": {
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
        "log_dir": "/tmp", "repeats": 3, "fresh_engine_per_pass": [],
        "cpu_linear": run.cpu_linear_run()}}
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
    assert args.method_names == ["none", "plain", "pld", "pld@tree"]
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
