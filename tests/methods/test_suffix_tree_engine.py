"""`suffix_tree` on the real engine: greedy output token-identical to plain
decoding at batch 1 and 8 (reference model, trees verified), under
preemption, prefix caching and chunked prefill (tiny model); the sampling
distribution kept (sharing the batch-1-and-8 check's engine)."""

from __future__ import annotations

import pytest

from tests.conftest import plain_greedy
from tests.methods.sampling import OneEngine, check_sampling_on
from tests.helpers.engine_checks import check_greedy_equal_on, check_preemption_lossless
from tests.helpers.prompts import COPY_MAX_TOKENS as MAX_TOKENS
from tests.helpers.prompts import copy_prompts
from vllm_specplug.sources import suffix_cache

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not suffix_cache.available(),
                                 reason="arctic-inference is not installed")]

# pinned size and a permissive tree: the trees verified are the method's own
# (the cost-aware cut may rightly verify little on a short run)
SPEC = {"method": "suffix_tree", "num_speculative_tokens": 12, "cost_aware": False,
        "max_spec_factor": 4.0, "min_token_prob": 0.02}


@pytest.fixture(scope="module")
def baseline(ref_model):
    prompts = copy_prompts(ref_model, 8)
    return prompts, plain_greedy(ref_model, prompts, MAX_TOKENS)


class TestOneEngine(OneEngine):
    spec = SPEC

    def test_lossless_batch_1_and_8_and_frees_requests(self, llm, baseline):
        stats = check_greedy_equal_on(llm, baseline, MAX_TOKENS)
        m = stats["method"]
        assert stats["tree_drafts"] > 0 and stats["accepted_tokens"] > 0, stats
        # every request's own tree freed but the flush request's (its end
        # reaches the worker with the next step); every output kept globally
        assert m["live_requests"] <= 1, m
        assert m["cached_responses"] == 10, m  # 1 + 8 + the flush request

    # slow: the rule that keeps the distribution is the runner's tree sampling, checked
    # in the default suite for every source at once, the head included (auto), and
    # for the head alone where arctic-inference is missing (eagle3_tree)
    @pytest.mark.slow
    def test_sampling_keeps_target_distribution(self, ref_model, llm):
        # many samples of one prompt: the global suffix tree holds the earlier
        # samples, so trees branch where the samples did
        stats = check_sampling_on(llm, SPEC, ref_model,
                                  "List the first ten prime numbers, one per line.", max_tokens=6)
        assert stats["method"]["cached_responses"] > 0


def test_preemption_prefix_caching_chunked_prefill(tiny_model):
    # drafts from the request's own output and from earlier requests'
    # outputs; pinned size, as the other methods' preemption tests (with the
    # budget on, whether it drafts depends on the step times at start-up)
    check_preemption_lossless(tiny_model, SPEC, seed=5)
