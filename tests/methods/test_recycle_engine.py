"""`recycle` on the real engine (reference model, float32) at a small
budget: measured template + copy path (shared table) stay
token-identical to plain decoding at batch 1 and 8."""

from __future__ import annotations

import pytest

from tests.methods.test_methods_engine import _check, baseline  # noqa: F401 (fixture)

pytestmark = pytest.mark.engine


def test_recycle_small_budget_copy_path_lossless(ref_model, baseline):  # noqa: F811
    stats = _check(ref_model, baseline, {"method": "recycle", "num_speculative_tokens": 8,
                                         "cost_aware": False})
    m = stats["method"]
    assert stats["accepted_tokens"] > 0 and stats["tree_drafts"] > 0
    # the copy path was drafted and verified: its estimate has moved off the prior
    assert m["copy_first_n4"] != pytest.approx(0.7)
