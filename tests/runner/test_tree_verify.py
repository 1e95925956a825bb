"""Tree verification on the real engine: random trees around the target's own
greedy continuation must give token-identical output and exactly the
expected accepted depth."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import engine, greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 48


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths straddle the CPU cache's block boundaries (multiples of 32/128).
    lengths = [5, 31, 33, 127, 129, 300, 17, 64]
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])]
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    prompts = _prompts(32, 500)
    with engine(tiny_model) as llm:
        outs = greedy(llm, prompts, MAX_TOKENS)
    path = tmp_path_factory.mktemp("oracle") / "ref.json"
    path.write_text(json.dumps([p + o for p, o in zip(prompts, outs)]))
    return prompts, outs, str(path)


# 32 behind slow (an engine start of its own): 8 requests already cover every
# prompt length here, several requests' trees in one step, and KV moves
@pytest.mark.parametrize("batch", [1, 8, pytest.param(32, marks=pytest.mark.slow)])
def test_random_trees_lossless_with_exact_depth(tiny_model, reference, batch):
    prompts, outs, ref_file = reference
    spec = {"method": "oracle", "num_speculative_tokens": 12,
            "reference_file": ref_file, "max_depth": 6}
    with engine(tiny_model, spec) as llm:
        got = greedy(llm, prompts[:batch], MAX_TOKENS)
        stats = llm.collective_rpc("specplug_stats")[0]
    assert got == outs[:batch]
    assert stats["tree_drafts"] > 0 and stats["kv_moves"] > 0
    # The oracle knows how deep each tree is right; the engine must agree.
    assert stats["accepted_tokens"] == stats["method"]["expected_accepted"]
    assert stats["drafts"] == stats["method"]["drafts"]
    # Per-source counts (runner, from the kept trees): only true nodes accepted.
    assert stats["source_accepted"] == {"truth": stats["accepted_tokens"]}
    assert stats["tree_attention"] == "native"


def test_random_trees_lossless_on_the_aten_path(tiny_model, reference, monkeypatch):
    """The fallback when the native CPU kernel cannot be built (no compiler):
    the same trees, the same output, through ATen calls."""
    from vllm_specplug.kernels import cpu_tree_attention

    monkeypatch.setenv(cpu_tree_attention.ENV_SWITCH, "0")  # the engine runs in-process
    prompts, outs, ref_file = reference
    spec = {"method": "oracle", "num_speculative_tokens": 12,
            "reference_file": ref_file, "max_depth": 6}
    with engine(tiny_model, spec) as llm:
        got = greedy(llm, prompts[:8], MAX_TOKENS)
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["tree_attention"] == "aten"
    assert got == outs[:8]
    assert stats["accepted_tokens"] == stats["method"]["expected_accepted"]
