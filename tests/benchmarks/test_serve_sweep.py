"""The serving sweep's plan, parsing and aggregation on hand-made inputs
(no server): :mod:`benchmarks.serve_points`, :mod:`benchmarks.serve_report`
and the driver's configuration."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve_points as sp
from benchmarks import serve_report, serve_sweep
from benchmarks.soak import parse_metrics

CFG = {"concurrency": [1, 4], "request_rates": [0.5], "temperatures": [0.0, 0.7],
       "prompts_per_stream": 3, "min_prompts": 5, "rate_seconds": 20, "warmup_prompts": 2}


def test_prompt_counts_per_load():
    assert sp.prompts_for("concurrency", 1, CFG) == 5  # min_prompts
    assert sp.prompts_for("concurrency", 4, CFG) == 12
    assert sp.prompts_for("rate", 0.5, CFG) == 10
    assert sp.prompts_for("rate", 0.1, CFG) == 5


def test_points_take_disjoint_slices_after_the_warmup():
    texts = [f"p{i}" for i in range(100)]
    points = sp.plan_points("d", texts, CFG)
    assert [(p.temperature, p.kind, p.value) for p in points] == [
        (0.0, "concurrency", 1), (0.0, "concurrency", 4), (0.0, "rate", 0.5),
        (0.7, "concurrency", 1), (0.7, "concurrency", 4), (0.7, "rate", 0.5)]
    assert [len(p.prompts) for p in points] == [5, 12, 10, 5, 12, 10]
    sent = [t for p in points for t in p.prompts]
    assert len(set(sent)) == len(sent) == 54
    assert sent[0] == "p2" and "p0" not in sent and "p1" not in sent
    assert sp.warmup_texts(texts, CFG) == ["p0", "p1"]
    assert points[0].name == "d-t0-c1" and points[2].name == "d-t0-r0.5"


def test_points_wrap_round_a_small_dataset():
    points = sp.plan_points("d", ["a", "b", "c"], CFG)
    assert points[0].prompts == ["c", "a", "b", "c", "a"]
    with pytest.raises(ValueError):
        sp.plan_points("d", [], CFG)


def test_sharegpt_file_reads_back_in_vllms_format(tmp_path):
    path = tmp_path / "p.json"
    sp.write_sharegpt_file(str(path), ["hello", "x y"])
    rows = json.loads(path.read_text())
    assert [r["conversations"][0] for r in rows] == [
        {"from": "human", "value": "hello"}, {"from": "human", "value": "x y"}]
    assert all(len(r["conversations"]) == 2 for r in rows)  # vLLM drops 1-turn rows


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_bench_command_per_load_kind():
    conc = sp.Point("specbench", 0.7, "concurrency", 8, ["a"] * 16)
    cmd = sp.bench_command(["vllm"], "http://h:1", "/m", conc, "/d.json", 128, "/r", "x.json")
    assert cmd[:3] == ["vllm", "bench", "serve"]
    assert _flag(cmd, "--max-concurrency") == "8" and _flag(cmd, "--request-rate") == "inf"
    assert _flag(cmd, "--num-prompts") == "16" and _flag(cmd, "--temperature") == "0.7"
    assert _flag(cmd, "--dataset-name") == "sharegpt"
    assert _flag(cmd, "--sharegpt-output-len") == "128"
    assert _flag(cmd, "--endpoint") == "/v1/chat/completions"
    assert "--disable-shuffle" in cmd and "--save-result" in cmd
    assert _flag(cmd, "--metric-percentiles") == "50,99"
    rate = sp.Point("sharegpt", 0.0, "rate", 0.25, ["a"] * 5)
    cmd = sp.bench_command(["vllm"], "http://h:1", "/m", rate, "/d.json", 64, "/r", "y.json")
    assert "--max-concurrency" not in cmd
    assert _flag(cmd, "--request-rate") == "0.25" and _flag(cmd, "--temperature") == "0"


BEFORE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
vllm:generation_tokens_total{engine="0",model_name="m"} 500.0
specplug:trees_total{method="pld"} 10.0
specplug:steps_total{method="pld"} 300.0
specplug:trees_created{method="pld"} 1.7e9
"""
AFTER = """vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 50.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 500.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 80.0
vllm:generation_tokens_total{engine="0",model_name="m"} 700.0
specplug:trees_total{method="pld"} 50.0
specplug:steps_total{method="pld"} 400.0
specplug:propose_faults_total{method="pld"} 0.0
specplug:trees_created{method="pld"} 1.7e9
"""


def test_spec_deltas_from_two_scrapes():
    d = sp.spec_deltas(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"], d["generation_tokens"]) == (
        40, 400, 60, 200)
    assert d["mean_accepted_length"] == pytest.approx(1 + 60 / 40)
    # 200 tokens from 140 passes (each pass: 1 + its accepted tokens), 40 drafted
    assert d["tau"] == pytest.approx(200 / 140)
    assert d["draft_share"] == pytest.approx(40 / 140)
    assert d["mean_tree_size"] == pytest.approx(10.0)
    assert d["specplug"] == {"trees": 40.0, "steps": 100.0}


def test_spec_deltas_without_drafts():
    d = sp.spec_deltas(parse_metrics(BEFORE), parse_metrics(BEFORE))
    assert d["drafts"] == 0 and d["tau"] is None and d["mean_accepted_length"] is None
    assert d["specplug"] == {}


BENCH = {"duration": 12.5, "completed": 7, "failed": 1, "output_throughput": 80.0,
         "request_throughput": 0.56, "total_output_tokens": 1000,
         "max_concurrent_requests": 4, "errors": ["", "boom", ""],
         "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0, "p50_ttft_ms": 90.0,
         "p99_ttft_ms": 300.0, "mean_tpot_ms": 40.0, "p50_tpot_ms": 38.0,
         "p99_tpot_ms": 70.0, "mean_itl_ms": 41.0, "p50_itl_ms": 39.0, "p99_itl_ms": 90.0,
         "mean_e2el_ms": 5000.0, "p50_e2el_ms": 4900.0, "p99_e2el_ms": 9000.0}


def test_point_record_takes_vllms_figures():
    point = sp.Point("specbench", 0.0, "concurrency", 4, ["a"] * 8)
    rec = sp.point_record("pld", "specplug", point, BENCH, {"tau": 2.0}, {"gated_steps": 3})
    assert rec["method"] == "pld" and rec["load"] == "concurrency" and rec["value"] == 4
    assert rec["num_prompts"] == 8 and rec["completed"] == 7 and rec["failed"] == 1
    assert rec["first_error"] == "boom"
    assert rec["output_throughput"] == 80.0 and rec["duration_s"] == 12.5
    assert rec["ttft_ms"] == {"mean": 100.0, "p50": 90.0, "p99": 300.0}
    assert rec["tpot_ms"] == {"mean": 40.0, "p50": 38.0, "p99": 70.0}
    assert rec["itl_ms"]["p99"] == 90.0 and rec["e2el_ms"]["p50"] == 4900.0
    assert rec["spec"] == {"tau": 2.0} and rec["budget"] == {"gated_steps": 3}


def test_budget_deltas():
    before = {"budget": {"steps": 10, "gated_steps": 2, "zero_steps": 0, "size_hist": {}},
              "steps": 40, "propose_seconds": 1.5, "source_nodes": {"copy": 5}}
    after = {"budget": {"steps": 30, "gated_steps": 12, "zero_steps": 1, "size_hist": {},
                        "gate_log": [[7, 0, 16, 0, -1.0, 2.0, 0.5, -3.5, -2.0, 0, 8]],
                        "draft_ms": 0.5},
             "steps": 70, "propose_seconds": 2.0,
             "source_nodes": {"copy": 9, "suffix": 3}, "source_accepted": {"copy": 2}}
    out = sp.budget_deltas(before, after)
    assert {k: out[k] for k in ("steps", "gated_steps", "zero_steps")} == {
        "steps": 20, "gated_steps": 10, "zero_steps": 1}
    # the gate's state at the point's end, not a difference
    assert out["gate"] == {"gate_log": after["budget"]["gate_log"], "draft_ms": 0.5}
    assert out["engine"] == {"steps": 30, "propose_seconds": 0.5,
                             "source_nodes": {"copy": 4, "suffix": 3},
                             "source_accepted": {"copy": 2}}
    first = sp.budget_deltas(None, {"budget": {"steps": 4}})
    assert first["steps"] == 4 and first["engine"] == {}
    assert sp.budget_deltas(before, {"drafts": 3}) is None


KINDS = {"none": "baseline", "plain": "specplug", "pld": "specplug", "suffix": "vllm"}


def _rec(method, load, value, tps, p99, tau=None, temp=0.0):
    return {"method": method, "method_kind": KINDS[method], "dataset": "specbench", "temperature": temp, "load": load,
            "value": value, "output_throughput": tps, "tpot_ms": {"p50": p99 / 2, "p99": p99},
            "spec": {"tau": tau} if tau else None}


DOC = {"run": {"model": "/x/ref"}, "records": [
    _rec("none", "concurrency", 1, 20.0, 50.0), _rec("none", "concurrency", 2, 30.0, 60.0),
    _rec("pld", "concurrency", 1, 30.0, 40.0, tau=2.5),
    _rec("pld", "concurrency", 2, 27.0, 66.0, tau=1.5),
    _rec("none", "rate", 0.5, 10.0, 55.0), _rec("pld", "concurrency", 1, 5.0, 9.0, temp=0.7)]}


def test_report_series_and_table():
    groups = serve_report.groups(DOC)
    assert set(groups) == {("specbench", 0.0), ("specbench", 0.7)}
    s = serve_report.series(groups[("specbench", 0.0)], "concurrency", "tpot_ms", "p99")
    assert s == {"none": [(1, 50.0), (2, 60.0)], "pld": [(1, 40.0), (2, 66.0)]}
    md = serve_report.render_markdown(DOC)
    assert "| method | c=1 | c=2 | 0.5 req/s |" in md
    assert ("| pld | 30.0 / 40 (1.50x / 0.80x), tau 2.50 | 27.0 / 66 (0.90x / 1.10x), "
            "tau 1.50 | - |") in md
    assert "| none | 20.0 / 50 | 30.0 / 60 | 10.0 / 55 |" in md


def test_plots_are_written(tmp_path):
    paths = serve_report.plot_all(DOC, str(tmp_path / "sweep"))
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == [
        "sweep_specbench_t0.7.png", "sweep_specbench_t0.png"]
    assert all((tmp_path / p.rsplit("/", 1)[-1]).stat().st_size > 1000 for p in paths)


def test_a_sweeps_plots_are_its_own_not_a_longer_named_sweeps(tmp_path, monkeypatch):
    from benchmarks import canonical, results_md

    monkeypatch.setattr(canonical, "RESULTS_DIR", tmp_path)
    for name in ("sweep_specbench_t0.png", "sweep_specbench_t0.7.png",
                 "sweep_more_specbench_t0.7.png"):  # the second sweep's plot
        (tmp_path / name).write_bytes(b"png")
    assert results_md.serving_plots(DOC, "sweep.json") == [
        "sweep_specbench_t0.7.png", "sweep_specbench_t0.png"]


def test_config_overrides_and_method_subset(tmp_path):
    cfg_path = tmp_path / "c.json"
    cfg_path.write_text(json.dumps({**CFG, "datasets": ["specbench"], "methods": {
        "none": None, "pld": {"method": "pld", "num_speculative_tokens": 8}}}))
    args = serve_sweep.parse_args(["--config", str(cfg_path), "--methods", "pld",
                                   "--concurrency", "1,2", "--request-rates", "",
                                   "--datasets", "sharegpt,specbench", "--output-len", "32"])
    cfg = serve_sweep.load_config(args)
    assert cfg["concurrency"] == [1, 2] and cfg["request_rates"] == []
    assert cfg["datasets"] == ["sharegpt", "specbench"] and cfg["output_len"] == 32
    assert cfg["temperatures"] == [0.0, 0.7] and list(cfg["methods"]) == ["pld"]
    bad = serve_sweep.parse_args(["--config", str(cfg_path), "--methods", "bogus"])
    with pytest.raises(SystemExit, match="bogus"):
        serve_sweep.load_config(bad)


def test_shipped_config_covers_the_issue_matrix():
    with open(serve_sweep.DEFAULT_CONFIG) as f:
        cfg = json.load(f)
    assert cfg["concurrency"] == [1, 2, 4, 8, 16, 32] and len(cfg["request_rates"]) == 2
    assert cfg["temperatures"] == [0.0, 0.7]
    assert cfg["repeats"] >= 3  # one estimator: a point's median over passes
    assert cfg["max_num_seqs"] >= 2 * max(cfg["concurrency"])  # room for rate points' queue
    assert {"none", "plain", "ngram", "suffix"} <= set(cfg["methods"])
    from vllm_specplug import registry

    shipped = set(registry.SHIPPED) - {"oracle", "plain"}
    assert shipped <= {s["method"] for s in cfg["methods"].values() if s}


def test_missing_datastore_is_a_skip_not_a_crash(tmp_path):
    m = serve_sweep.resolve_method("dresd", {"method": "dresd", "num_speculative_tokens": 16,
                                             "datastore": str(tmp_path / "none")})
    assert m["kind"] == "specplug" and "not found" in m["skip"]
    assert serve_sweep.resolve_method("none", None) == {
        "name": "none", "kind": "baseline", "spec": None, "skip": None}


def test_targets_name_each_miss():
    doc = {"records": [
        _rec("none", "concurrency", 1, 20.0, 50.0), _rec("none", "concurrency", 2, 30.0, 60.0),
        _rec("pld", "concurrency", 1, 30.0, 40.0), _rec("pld", "concurrency", 2, 28.5, 61.5),
        _rec("suffix", "concurrency", 1, 25.0, 45.0), _rec("suffix", "concurrency", 2, 29.0, 61.0),
        _rec("none", "rate", 0.5, 10.0, 55.0), _rec("pld", "rate", 0.5, 10.0, 55.0)]}
    misses = serve_report.targets(doc)
    # c=2: 28.5/30 = 0.95x (< 0.97x), 61.5/60 = 1.025x (within 1.03x), suffix ahead
    assert misses == ["specbench T=0 c=2 pld: output tok/s 0.95x none (< 0.97x)",
                      "specbench T=0 c=2: suffix 29.0 >= best specplug (pld) 28.5 tok/s"]
    doc["records"][2] = _rec("pld", "concurrency", 1, 25.0, 40.0)
    assert "specbench T=0 c=1: best specplug (pld) 1.25x none (< 1.3x)" in (
        serve_report.targets(doc))


def test_point_record_keeps_vllms_own_spec_figures():
    point = sp.Point("specbench", 0.0, "concurrency", 1, ["a"])
    bench = {**BENCH, "spec_decode_acceptance_length": 2.5, "spec_decode_num_drafts": 4,
             "spec_decode_per_position_acceptance_rates": [0.5, 0.2]}
    rec = sp.point_record("pld", "specplug", point, bench, None)
    assert rec["bench_spec"] == {"spec_decode_acceptance_length": 2.5,
                                 "spec_decode_num_drafts": 4}
    assert sp.point_record("none", "baseline", point, BENCH, None)["bench_spec"] is None


SIGTERM_SCRIPT = r'''
import os, signal, sys, time
from benchmarks import serve_sweep

marker = sys.argv[1]

class FakeServer:
    """A server that comes up and never finishes a point."""
    def __init__(self, *args, **kwargs):
        pass
    def wait_ready(self, timeout):
        open(marker + ".up", "w").close()
        time.sleep(60)
    def stop(self):
        open(marker, "w").write("stopped")

serve_sweep.SweepServer = FakeServer
serve_sweep.exit_on_sigterm()
serve_sweep.run_method({"name": "pld", "spec": {}, "kind": "specplug"}, "m", {},
                       {}, [], type("A", (), {"eager": False, "start_timeout": 1})(),
                       os.path.dirname(marker), None)
'''


def test_sigterm_stops_the_running_server(tmp_path):
    """A sweep sent SIGTERM (a job stopped from outside) stops its server
    before it exits, instead of leaving an engine holding memory."""
    import signal
    import subprocess
    import sys
    import time

    from benchmarks.machine import REPO_ROOT

    marker = tmp_path / "server"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(marker)],
                            cwd=REPO_ROOT, env={**__import__("os").environ,
                                                "PYTHONPATH": str(REPO_ROOT)})
    deadline = time.time() + 60
    while not (tmp_path / "server.up").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "stopped"


def test_points_of_several_passes_report_their_median():
    """``--repeats``: a point measured on three servers is one record in
    every table, plot and target check: the medians, the tokens/s' min-max."""
    doc = {"records": [
        {**_rec("none", "concurrency", 1, tps, p99), "pass": i}
        for i, (tps, p99) in enumerate([(20.0, 50.0), (26.0, 40.0), (22.0, 70.0)])] + [
        {**_rec("pld", "concurrency", 1, tps, p99, tau=tau), "pass": i}
        for i, (tps, p99, tau) in enumerate([(30.0, 40.0, 2.0), (21.0, 45.0, 1.5),
                                             (33.0, 35.0, 2.5)])]}
    (recs,) = serve_report.groups(doc).values()
    none, pld = recs
    assert none["output_throughput"] == 22.0 and none["tpot_ms"]["p99"] == 50.0
    assert pld["passes"] == 3 and pld["output_throughput_range"] == [21.0, 33.0]
    assert pld["output_throughput"] == 30.0 and pld["spec"]["tau"] == 2.0
    assert doc["records"][3]["output_throughput"] == 30.0  # the passes stay as measured
    table = serve_report.render_markdown(doc)
    assert "30.0 [21.0-33.0] / 40 (1.36x / 0.80x), tau 2.00" in table
    assert serve_report.targets(doc) == []  # 30/22 >= 1.3 at c=1


def test_repeats_run_pass_by_pass_on_fresh_servers(tmp_path, monkeypatch):
    """Every method once per pass, pass after pass, each on its own server;
    each record says its pass."""
    started = []

    def fake_run_method(method, model, cfg, datasets, points, args, work, on_record,
                        pass_index=0):
        started.append((pass_index, method["name"]))
        on_record({"method": method["name"], "pass": pass_index})

    monkeypatch.setattr(serve_sweep, "run_method", fake_run_method)
    monkeypatch.setattr(serve_sweep, "load_datasets", lambda cfg, model: {"specbench": ["a"] * 8})
    monkeypatch.setattr(serve_sweep, "machine_info", lambda: {})
    monkeypatch.setattr(serve_sweep, "exit_on_sigterm", lambda: None)  # not pytest's
    cfg_path = tmp_path / "c.json"
    cfg_path.write_text(json.dumps({**CFG, "datasets": ["specbench"], "methods": {
        "none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4}}}))
    out = tmp_path / "s.json"
    monkeypatch.setattr(serve_sweep, "new_document", lambda *a: {
        "run": {}, "skipped": [], "failed": [], "records": []})
    monkeypatch.setattr("benchmarks.serve_report.plot_all", lambda doc, prefix: [])
    assert serve_sweep.main(["--config", str(cfg_path), "--repeats", "2", "--model", "m",
                             "--out", str(out), "--log-dir", str(tmp_path)]) == 0
    assert started == [(0, "none"), (0, "ngram"), (1, "none"), (1, "ngram")]
    assert [r["pass"] for r in json.loads(out.read_text())["records"]] == [0, 0, 1, 1]


def test_the_recorded_command_keeps_an_empty_value_quoted():
    import argparse
    import shlex

    argv = ["--methods", "none", "--request-rates", "", "--repeats", "1"]
    doc = serve_sweep.new_document(argparse.Namespace(eager=False), argv, {}, "m", {}, [])
    # re-running the recorded command parses back to the same arguments
    assert shlex.split(doc["run"]["command"])[3:] == argv
