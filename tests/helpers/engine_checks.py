"""Checks of a method on a real engine, shared by the method engine tests."""

from __future__ import annotations

from tests.conftest import engine, greedy


def flush(llm) -> None:
    """vLLM tells the workers which requests finished with the *next* step;
    one more one-token request delivers that for everything before it."""
    greedy(llm, [[5, 6, 7]], 1)


def check_greedy_equal(model: str, baseline, spec: dict, max_tokens: int) -> dict:
    """Assert ``spec`` decodes ``baseline``'s prompts greedily to its plain
    outputs at batch 1 and at the whole batch; returns the stats, every
    request's end delivered (``flush``)."""
    with engine(model, spec, max_model_len=1024) as llm:
        return check_greedy_equal_on(llm, baseline, max_tokens)


def check_greedy_equal_on(llm, baseline, max_tokens: int, first: int = 0) -> dict:
    """The same check through an open engine (batch 1: prompt ``first``)."""
    prompts, ref = baseline
    assert greedy(llm, prompts[first:first + 1], max_tokens) == ref[first:first + 1]
    assert greedy(llm, prompts, max_tokens) == ref
    flush(llm)
    return llm.collective_rpc("specplug_stats")[0]


def check_preemption_lossless(model: str, spec: dict, seed: int, max_tokens: int = 40) -> dict:
    """Assert ``spec`` decodes 18 random prompts (7-300 tokens) greedily to
    plain decoding's outputs in a cache of 10 blocks (preemption), with
    chunked prefill, twice (the second time from the prefix cache); returns
    the stats after asserting that requests were preempted and drafts
    accepted (a tiny random model repeats itself, so they are)."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in [300, 250, 40, 129, 7, 33] * 3]
    with engine(model) as llm:
        ref = greedy(llm, prompts, max_tokens)
    with engine(model, spec, num_gpu_blocks_override=10, enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=128) as llm:
        assert greedy(llm, prompts, max_tokens) == ref
        assert greedy(llm, prompts, max_tokens) == ref  # prompts from the prefix cache
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["preempted"] > 0 and stats["accepted_tokens"] > 0, stats
    return stats
