"""Merging a matrix run in parts: a stored run split by method and merged
back gives the same records; parts with other settings are refused."""

import json
from pathlib import Path

import pytest

from benchmarks import merge, report

STORED = Path(__file__).resolve().parents[2] / "benchmarks/results/issue20_n8.json"


def _split(doc, methods):
    part = json.loads(json.dumps(doc))
    part["records"] = [r for r in part["records"] if r["method"] in ("none", *methods)]
    part["run"]["methods"] = [m for m in part["run"]["methods"]
                              if m["name"] in ("none", *methods)]
    return part


def test_split_and_merge_round_trip():
    doc = json.loads(STORED.read_text())
    a = _split(doc, ("pld", "adapld"))
    b = _split(doc, ("adapld@paper", "recycle"))
    out = merge.merge([a, b])
    key = lambda r: (r["method"], r["suite"], r["batch_size"])  # noqa: E731
    assert sorted(map(key, out["records"])) == sorted(map(key, doc["records"]))
    assert not report.validate(out)
    assert {m["name"] for m in out["run"]["methods"]} == {m["name"] for m in doc["run"]["methods"]}
    assert out["run"]["command"].count("benchmarks.run") == 2


def test_parts_with_other_settings_or_other_plain_outputs_are_refused():
    doc = json.loads(STORED.read_text())
    a, b = _split(doc, ("pld",)), _split(doc, ("recycle",))
    b["run"]["max_tokens"] = 64
    with pytest.raises(merge.MergeError, match="max_tokens"):
        merge.merge([a, b])
    b = _split(doc, ("recycle",))
    next(r for r in b["records"] if r["method"] == "none")["generated_tokens"] += 1
    with pytest.raises(merge.MergeError, match="plain decoding differs"):
        merge.merge([a, b])
