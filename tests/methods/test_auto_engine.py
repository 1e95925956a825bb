"""`auto` on the real engine: greedy output token-identical to plain
decoding at batch 1 and 8 with every source drafting (reference model: it
has a head), under preemption, prefix caching and chunked prefill without a
head (tiny model), and the sampling distribution kept."""

from __future__ import annotations

import random

import pytest

from tests.conftest import engine, greedy, plain_greedy
from tests.helpers.engine_checks import check_greedy_equal
from tests.helpers.prompts import COPY_MAX_TOKENS as MAX_TOKENS
from tests.helpers.prompts import copy_prompts
from tests.methods.sampling import check_sampling_keeps_distribution
from vllm_specplug.sources import suffix_cache

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not suffix_cache.available(),
                                 reason="arctic-inference is not installed")]

# pinned size (the cost-aware cut may rightly verify little on a short run)
# and the head asked for every request: every source's nodes get verified
SPEC = {"method": "auto", "num_speculative_tokens": 12, "cost_aware": False,
        "use_head": "always", "depth": 4, "topk": 4}


def test_lossless_batch_1_and_8_every_source(ref_model):
    prompts = copy_prompts(ref_model, 8)
    baseline = prompts, plain_greedy(ref_model, prompts, MAX_TOKENS)
    stats = check_greedy_equal(ref_model, baseline, SPEC, MAX_TOKENS)
    m = stats["method"]
    assert stats["tree_drafts"] > 0 and stats["accepted_tokens"] > 0, stats
    for source in ("head", "suffix"):
        assert m.get(f"{source}_accepted", 0) > 0, m
    assert any(m.get(f"copy{n}_drafts", 0) for n in range(1, 5)), m
    assert m["head_asked"] > 0 and m["head_skipped"] == 0, m


def test_preemption_prefix_caching_chunked_prefill_without_a_head(tiny_model):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in [300, 250, 40, 129, 7, 33] * 3]
    with engine(tiny_model) as llm:
        ref = greedy(llm, prompts, 40)
    spec = {"method": "auto", "num_speculative_tokens": 12, "cost_aware": False}
    with engine(tiny_model, spec, num_gpu_blocks_override=10, enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=128) as llm:
        assert greedy(llm, prompts, 40) == ref
        assert greedy(llm, prompts, 40) == ref  # prompts from the prefix cache
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["preempted"] > 0 and stats["accepted_tokens"] > 0, stats
    assert "head_asked" not in stats["method"]  # no head for the tiny model


def test_sampling_keeps_target_distribution(ref_model):
    stats = check_sampling_keeps_distribution(
        ref_model, SPEC, "List the first ten prime numbers, one per line.", max_tokens=4)
    assert stats["method"]["head_asked"] > 0
