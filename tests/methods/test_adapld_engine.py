"""`adapld` on the real engine (reference model, float32): its defaults
start at any budget and stay token-identical to plain decoding at batch 1
and 8, scored (default) and paper-literal."""

from __future__ import annotations

import pytest

from tests.helpers.engine_checks import check_greedy_equal
from tests.helpers.prompts import COPY_MAX_TOKENS

pytestmark = pytest.mark.engine


# All behind slow (default-suite time, 30 min): the default suite keeps
# adapld's defaults lossless at batch 1 and 8 in
# test_methods_engine.test_adapld_lossless_and_frees_memory (budget 12).
@pytest.mark.parametrize("budget,paper", [
    pytest.param(1, False, marks=pytest.mark.slow),
    pytest.param(2, False, marks=pytest.mark.slow),
    pytest.param(8, False, marks=pytest.mark.slow),
    pytest.param(8, True, marks=pytest.mark.slow)])
def test_adapld_defaults_any_budget_lossless(ref_model, copy_baseline, budget, paper):
    spec = {"method": "adapld", "num_speculative_tokens": budget, "cost_aware": False}
    if paper:
        spec["paper_literal"] = True
    stats = check_greedy_equal(ref_model, copy_baseline, spec, COPY_MAX_TOKENS)
    m = stats["method"]
    assert stats["accepted_tokens"] > 0
    assert m["drafts_lexical"] > 0
    if not paper:
        # both anchor paths drafted: copies after a 2+ token match, and the
        # hidden-state rerank after a single-token match (``rerank_single``),
        # which natural text meets at almost every step without a longer one
        assert m["suffix_anchors"] > 0 and m["rerank_anchors"] > 0
