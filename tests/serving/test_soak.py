"""The soak (``benchmarks/soak.py``): `specplug serve` on the reference model
under 32 concurrent mixed requests with client aborts, checked for errors,
greedy equality with plain decoding, flat memory, freed per-request state
and consistent /metrics. A short run is in the default suite; the long one
(10 minutes per method, ``SPECPLUG_SOAK_SECONDS`` to change) is ``slow``."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.soak import build_store, soak

pytestmark = pytest.mark.engine

METHODS = {
    "pld": {"num_speculative_tokens": 8, "tree_branches": 3},
    "recycle": {"num_speculative_tokens": 8},
    "adapld": {"num_speculative_tokens": 10},
    "dresd": {"num_speculative_tokens": 16, "greedy_num_drafts": 2, "greedy_draft_len": 8},
}


def _spec(method: str, ref_model: str, tmp_path) -> dict:
    spec = {"method": method, **METHODS[method]}
    if method == "dresd":
        spec["datastore"] = build_store(ref_model, str(tmp_path / "store"))
    return spec


def _assert_passed(report: dict) -> None:
    failed = [k for k, ok in report["checks"].items() if not ok]
    assert not failed, (failed, json.dumps(report["spec_server"], indent=1)[:4000],
                        report["mismatch_examples"])
    s = report["spec_server"]
    assert s["aborted"] > 0 and s["completed"] > 0
    assert s["metrics"]["spec_drafts"] > 0  # it did speculate
    assert report["greedy_compared"] > 0


@pytest.mark.slow  # default-suite time budget (30 min)
def test_soak_short(ref_model, tmp_path):
    """One minute of load: pld with trees, 32 workers, aborts."""
    report = soak(ref_model, _spec("pld", ref_model, tmp_path), duration=60,
                  max_requests=400, max_tokens=32, log_dir=str(tmp_path))
    _assert_passed(report)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_soak_long(method, ref_model, tmp_path):
    seconds = float(os.environ.get("SPECPLUG_SOAK_SECONDS", 600))
    report = soak(ref_model, _spec(method, ref_model, tmp_path), duration=seconds,
                  max_requests=20_000, max_tokens=64, log_dir=str(tmp_path))
    _assert_passed(report)
