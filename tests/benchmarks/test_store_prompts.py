"""A benchmark datastore must not hold the answers to the prompts a run
measures (``benchmarks/store_prompts.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import run, store_prompts, suites

REPO = Path(__file__).resolve().parents[2]


def _suite(name, texts, used):
    s = suites.Suite(name, "mem", texts)
    s.used_texts = used
    return s


def test_overlap_counts_measured_prompts_the_store_holds(tmp_path):
    store = str(tmp_path / "store")
    assert store_prompts.overlap(store, []) is None  # no prompt list: cannot tell
    path = store_prompts.record(store, ["q3", "q4", "q5", "other"], ["qa"])
    assert path == store + ".prompts.json"
    assert json.loads(Path(path).read_text())["suites"] == ["qa"]
    # measured: the first prompts of each suite; q3/q4 would be copied
    qa = _suite("qa", ["q1", "q2", "q3", "q4", "q5"], ["q1", "q2", "q3", "q4"])
    code = _suite("code", ["c1", "q5"], ["c1"])  # q5 is in the store, not measured
    assert store_prompts.overlap(store, [qa, code]) == {"qa": 2}
    assert store_prompts.overlap(store + "/", [code]) == {}  # a folder's trailing slash


def test_tokenize_records_the_texts_it_used(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    s = suites.Suite("x", "mem", ["short", "x" * 5000, "also short", "third"])
    suites.tokenize(s, tok, limit=2, max_prompt_len=200)
    assert s.used_texts == ["short", "also short"]


def test_check_datastores_stops_a_contaminated_run(tmp_path):
    store = str(tmp_path / "sa")
    store_prompts.record(store, ["b"], ["mine"])
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
    store_prompts.record(str(store), ["Name a colour."], ["mine"])
    opts = json.dumps({"reader": {"datastore": str(store)}})
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--methods", "none,reader",
         "--suites", str(prompts), "--batch", "1", "--method-options", opts,
         "--out", str(tmp_path / "r.json"), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "holds the target's answers to measured prompts (mine: 1)" in proc.stdout + proc.stderr
    assert not (tmp_path / "r.json").exists()
