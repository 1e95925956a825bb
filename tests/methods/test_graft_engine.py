"""`graft` on the real engine (reference model, shipped head): greedy output
token-identical to plain decoding at batch 1 and 8 with prefix caching and
chunked prefill, every stage used, retrieval nodes in the trees; preemption
and the sampling distribution behind ``slow``."""

from __future__ import annotations

import pytest

from tests.conftest import engine, greedy, plain_greedy
from tests.methods.sampling import check_sampling_keeps_distribution
from tests.helpers.prompts import PREAMBLE, spec_bench_prompts
from tests.helpers.prompts import SPEC_BENCH_MAX_TOKENS as MAX_TOKENS

pytestmark = pytest.mark.engine

# Small head passes (a CPU step pays for them); checkpoints d0, d1, d3 so
# that every stage fires on a short run; the cost-aware cut is off so the
# trees verified are graft's own.
SPEC = {"method": "graft", "num_speculative_tokens": 16, "depth": 5, "topk": 6,
        "checkpoints": [0, 1, 3], "thresholds": [0.3, 0.3, 0.5], "cost_aware": False}


@pytest.fixture(scope="module")
def baseline(ref_model):
    prompts = spec_bench_prompts(ref_model, 4) + spec_bench_prompts(ref_model, 4, PREAMBLE)
    return prompts, plain_greedy(ref_model, prompts, MAX_TOKENS)


def test_lossless_batch_1_and_8_prefix_caching(ref_model, baseline):
    prompts, ref = baseline
    # steps of 160 tokens: the preamble prompts (250-330 tokens) are
    # prefilled in chunks, and the batch's 8 trees of 17 rows fit one step
    with engine(ref_model, SPEC, max_model_len=1024, enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=160) as llm:
        assert greedy(llm, prompts[4:5], MAX_TOKENS) == ref[4:5]  # batch 1
        assert greedy(llm, prompts, MAX_TOKENS) == ref  # batch 8, cached preamble
        stats = llm.collective_rpc("specplug_stats")[0]
    m = stats["method"]
    assert stats["accepted_tokens"] > 0 and m["store_misses"] == 0, stats
    stages = [m[f"stage_{s}"] for s in ("d0", "d1", "d3", "unpruned")]
    assert sum(stages) > 0 and sum(1 for s in stages if s) >= 2, m
    assert m["nodes_adjacency"] > 0 and m["nodes_draft"] > 0, m


@pytest.mark.slow
def test_lossless_under_preemption(ref_model, baseline):
    prompts, ref = baseline
    with engine(ref_model, SPEC, max_model_len=512, num_gpu_blocks_override=5) as llm:
        assert greedy(llm, prompts, MAX_TOKENS) == ref
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["preempted"] > 0 and stats["accepted_tokens"] > 0


# slow: the rule that keeps the distribution is the runner's tree sampling, checked
# in the default suite for every source at once, the head included (auto), and
# for the head alone where arctic-inference is missing (eagle3_tree)
@pytest.mark.slow
def test_sampling_keeps_target_distribution(ref_model):
    spec = {**SPEC, "num_speculative_tokens": 8, "depth": 3, "topk": 4,
            "checkpoints": [0, 1]}
    spec["thresholds"], spec["draft_nodes"] = [0.3, 0.3], [8, 24]
    spec["templates"] = ["graft_d0", "graft_d1"]
    check_sampling_keeps_distribution(ref_model, spec, "Count from 1 to 10.")
