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
    prompts, ref = baseline
    with engine(model, spec, max_model_len=1024) as llm:
        assert greedy(llm, prompts[:1], max_tokens) == ref[:1]
        assert greedy(llm, prompts, max_tokens) == ref
        flush(llm)
        return llm.collective_rpc("specplug_stats")[0]
