"""`recycle` on the real engine (reference model, float32) at a small
budget: measured template + copy path (shared table) stay
token-identical to plain decoding at batch 1 and 8."""

from __future__ import annotations

import pytest

from tests.helpers.engine_checks import check_greedy_equal
from tests.helpers.prompts import COPY_MAX_TOKENS
from tests.methods.sampling import check_sampling_keeps_distribution

pytestmark = pytest.mark.engine


def test_recycle_small_budget_copy_path_lossless(ref_model, copy_baseline):
    spec = {"method": "recycle", "num_speculative_tokens": 8, "cost_aware": False}
    stats = check_greedy_equal(ref_model, copy_baseline, spec, COPY_MAX_TOKENS)
    m = stats["method"]
    assert stats["accepted_tokens"] > 0 and stats["tree_drafts"] > 0
    # the copy path was drafted and verified: its estimate has moved off the prior
    assert m["copy_first_n4"] != pytest.approx(0.7)


def test_sampling_keeps_target_distribution(ref_model):
    # the shared table learns from the earlier samples of the same prompt,
    # so later samples are drafted and verified through its trees
    spec = {"method": "recycle", "num_speculative_tokens": 8, "cost_aware": False}
    check_sampling_keeps_distribution(ref_model, spec, "Count from 1 to 10.")
