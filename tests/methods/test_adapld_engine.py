"""`adapld` on the real engine (reference model, float32): its defaults
start at any budget and stay token-identical to plain decoding at batch 1
and 8, scored (default) and paper-literal."""

from __future__ import annotations

import pytest

from tests.methods.test_methods_engine import _check, baseline  # noqa: F401 (fixture)

pytestmark = pytest.mark.engine


# All behind slow (default-suite time, 30 min): the default suite keeps
# adapld's defaults lossless at batch 1 and 8 in
# test_methods_engine.test_adapld_lossless_and_frees_memory (budget 12).
@pytest.mark.parametrize("budget,paper", [
    pytest.param(1, False, marks=pytest.mark.slow),
    pytest.param(2, False, marks=pytest.mark.slow),
    pytest.param(8, False, marks=pytest.mark.slow),
    pytest.param(8, True, marks=pytest.mark.slow)])
def test_adapld_defaults_any_budget_lossless(ref_model, baseline, budget, paper):  # noqa: F811
    spec = {"method": "adapld", "num_speculative_tokens": budget, "cost_aware": False}
    if paper:
        spec["paper_literal"] = True
    stats = _check(ref_model, baseline, spec)
    m = stats["method"]
    assert stats["accepted_tokens"] > 0
    assert m["drafts_lexical"] > 0
    if not paper:
        assert m["suffix_anchors"] > 0 and m["rerank_anchors"] >= 0
