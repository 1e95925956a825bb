"""A benchmark run refuses a method whose datastore holds the answers to
the prompts it measures (:mod:`vllm_specplug.datastore.prompt_list`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import run
from vllm_specplug import suites
from vllm_specplug.datastore import prompt_list

REPO = Path(__file__).resolve().parents[2]


def _suite(name, texts, used):
    s = suites.Suite(name, "mem", texts)
    s.used_texts = used
    return s


def test_check_datastores_stops_a_contaminated_run(tmp_path):
    store = str(tmp_path / "sa")
    prompt_list.record(store, ["b"], ["mine"])
    mine = _suite("mine", ["a", "b"], ["a", "b"])
    methods = [{"name": "reader", "options": {"datastore": store}, "skip": None}]
    try:
        run.check_datastores(methods, [mine])
        raise AssertionError("a store holding a measured prompt must stop the run")
    except run._Stop as e:
        assert "mine: 1" in str(e) and "reader" in str(e)
    # the same store against other prompts, or a skipped method: fine
    run.check_datastores(methods, [_suite("mine", ["a"], ["a"])])
    run.check_datastores([dict(methods[0], skip="not installed")], [mine])


def test_run_refuses_before_starting_any_engine(tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "What is two and two?"}\n{"prompt": "Name a colour."}\n')
    store = tmp_path / "sa"
    prompt_list.record(str(store), ["Name a colour."], ["mine"])
    opts = json.dumps({"reader": {"datastore": str(store)}})
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--methods", "none,reader",
         "--suites", str(prompts), "--batch", "1", "--method-options", opts,
         "--out", str(tmp_path / "r.json"), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "holds the target's answers to measured prompts (mine: 1)" in proc.stdout + proc.stderr
    assert not (tmp_path / "r.json").exists()
