"""A datastore's prompt list (``<store>.prompts.json``): which measured
prompts' answers a store holds."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_specplug import suites
from vllm_specplug.datastore import prompt_list


def _suite(name, texts, used):
    s = suites.Suite(name, "mem", texts)
    s.used_texts = used
    return s


def test_overlap_counts_measured_prompts_the_store_holds(tmp_path):
    store = str(tmp_path / "store")
    assert prompt_list.overlap(store, []) is None  # no prompt list: cannot tell
    path = prompt_list.record(store, ["q3", "q4", "q5", "other"], ["qa"])
    assert path == store + ".prompts.json"
    assert json.loads(Path(path).read_text())["suites"] == ["qa"]
    # measured: the first prompts of each suite; q3/q4 would be copied
    qa = _suite("qa", ["q1", "q2", "q3", "q4", "q5"], ["q1", "q2", "q3", "q4"])
    code = _suite("code", ["c1", "q5"], ["c1"])  # q5 is in the store, not measured
    assert prompt_list.overlap(store, [qa, code]) == {"qa": 2}
    assert prompt_list.overlap(store + "/", [code]) == {}  # a folder's trailing slash

