"""`pld` on the reference model: lossless (chain and tree) and on par with
vLLM's built-in `ngram` at the same settings."""

from __future__ import annotations

import pytest

from tests.conftest import engine, greedy, plain_greedy, run_isolated, spec_counters
from tests.helpers.prompts import COPY_MAX_TOKENS, copy_prompts

pytestmark = pytest.mark.engine

MAX_TOKENS = COPY_MAX_TOKENS


@pytest.fixture(scope="module")
def baseline(ref_model):
    prompts = copy_prompts(ref_model, 8)
    return prompts, plain_greedy(ref_model, prompts, MAX_TOKENS)


# branches=3 (trees) behind `slow`: the default suite verifies multi-branch
# copy-path trees from the same matcher through auto's copy source
# (copy_branches 2; tests/runner/test_compiled_lossless.test_auto_tree_compiled,
# compiled, batch 1 and 8)
@pytest.mark.parametrize("branches", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_pld_lossless_batch_1_and_8(ref_model, baseline, branches):
    prompts, ref = baseline
    spec = {"method": "pld", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2, "tree_branches": branches}
    with engine(ref_model, spec, max_model_len=1024) as llm:
        assert greedy(llm, prompts[:1], MAX_TOKENS) == ref[:1]
        assert greedy(llm, prompts, MAX_TOKENS) == ref
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["accepted_tokens"] > 0
    if branches > 1:
        assert stats["tree_drafts"] > 0


def _mean_accepted(model, spec, prompts):
    with engine(model, spec, max_model_len=1024) as llm:
        out = greedy(llm, prompts, MAX_TOKENS)
        c = spec_counters(llm)
    return out, 1 + c["accepted_tokens"] / c["drafts"]


@pytest.mark.slow  # default-suite time budget (30 min)
def test_pld_chain_matches_builtin_ngram(ref_model, baseline):
    prompts, ref = baseline
    shared = {"num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    mal = {}
    for method in ("ngram", "pld"):
        # pld drafts as ngram does only at a pinned size (no cost-aware cut)
        own = {"cost_aware": False} if method == "pld" else {}
        out, mal[method] = run_isolated(
            _mean_accepted, ref_model, {"method": method, **shared, **own}, prompts)
        assert out == ref, method
    assert abs(mal["pld"] - mal["ngram"]) <= 0.05 * mal["ngram"], mal
