"""`recycle` on the real engine (reference model, float32) at a small
budget: measured template + copy path (shared table) stay
token-identical to plain decoding at batch 1 and 8."""

from __future__ import annotations

import pytest

from tests.helpers.engine_checks import check_greedy_equal_on
from tests.helpers.prompts import COPY_MAX_TOKENS
from tests.methods.sampling import OneEngine, check_sampling_on

pytestmark = pytest.mark.engine


SPEC = {"method": "recycle", "num_speculative_tokens": 8, "cost_aware": False}


class TestOneEngine(OneEngine):
    spec = SPEC
    baseline = "copy_baseline"

    def test_recycle_small_budget_copy_path_lossless(self, llm, copy_baseline):
        stats = check_greedy_equal_on(llm, copy_baseline, COPY_MAX_TOKENS)
        m = stats["method"]
        assert stats["accepted_tokens"] > 0 and stats["tree_drafts"] > 0
        # the copy path was drafted and verified: its estimate has moved off the prior
        assert m["copy_first_n4"] != pytest.approx(0.7)

    # slow: the rule that keeps the distribution is the runner's tree sampling, checked
    # in the default suite for every source at once (auto) and for the head (eagle3_tree)
    @pytest.mark.slow
    def test_sampling_keeps_target_distribution(self, ref_model, llm):
        # the shared table learns from the earlier samples of the same prompt,
        # so later samples are drafted and verified through its trees
        check_sampling_on(llm, SPEC, ref_model, "Count from 1 to 10.")
