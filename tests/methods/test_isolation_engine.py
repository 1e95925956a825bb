"""Tenant isolation on the real engine (`suffix_tree`, tiny model, offline
``LLM.generate`` with vLLM's own ``cache_salt``): a tenant drafts from its
own earlier answers and never from another tenant's, requests without a
salt share one public pool, ``off`` shares across salts, ``strict`` shares
nothing, and every output equals plain greedy decoding.

Acceptance is compared exactly: batch 1, greedy, a pinned tree size and no
cost-aware cut, so a request's drafts depend only on its tokens and on the
suffix trees it may read."""

from __future__ import annotations

import random

import pytest

from tests.conftest import engine, plain_greedy
from vllm_specplug.sources import suffix_cache

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not suffix_cache.available(),
                                 reason="arctic-inference is not installed")]

SPEC = {"method": "suffix_tree", "num_speculative_tokens": 12, "cost_aware": False,
        "max_spec_factor": 4.0, "min_token_prob": 0.02}
MAX_TOKENS = 64


def _prompt() -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(3, 500) for _ in range(40)]


def gen(llm, prompt: list[int], salt: str | None):
    """One request to completion: (its tokens, (accepted tokens, trees
    drafted) during it)."""
    from vllm import SamplingParams, TokensPrompt

    before = llm.collective_rpc("specplug_stats")[0]
    tokens = TokensPrompt(prompt_token_ids=prompt)
    if salt is not None:
        tokens["cache_salt"] = salt
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([tokens], params, use_tqdm=False)
    after = llm.collective_rpc("specplug_stats")[0]
    return (list(out[0].outputs[0].token_ids),
            (after["accepted_tokens"] - before["accepted_tokens"],
             after["tree_drafts"] - before["tree_drafts"]))


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompt = _prompt()
    return prompt, plain_greedy(tiny_model, [prompt], MAX_TOKENS)[0]


def test_tenants_draft_only_from_their_own_answers(tiny_model, reference):
    prompt, ref = reference
    with engine(tiny_model, SPEC) as llm:
        a1, fresh = gen(llm, prompt, "tenant-a")
        b, b_counts = gen(llm, prompt, "tenant-b")
        a2, a2_counts = gen(llm, prompt, "tenant-a")
        n1, n1_counts = gen(llm, prompt, None)
        n2, n2_counts = gen(llm, prompt, None)
    assert [a1, b, a2, n1, n2] == [ref] * 5
    # the first answer of each pool drafts as in a fresh engine (from the
    # request's own tokens only: this prompt's answer does not repeat itself)
    assert b_counts == fresh and n1_counts == fresh
    # asked again, a pool replays its earlier answer
    assert a2_counts[0] > fresh[0], (a2_counts, fresh)
    assert n2_counts[0] > fresh[0], (n2_counts, fresh)


def _off_and_strict(tiny_model: str) -> dict[str, list]:
    prompt = _prompt()
    runs = {}
    for isolation in ("off", "strict"):
        with engine(tiny_model, {**SPEC, "isolation": isolation}) as llm:
            runs[isolation] = [gen(llm, prompt, salt) for salt in ("tenant-a", "tenant-b")]
    return runs


@pytest.mark.slow  # two more engines
def test_off_shares_across_salts_and_strict_shares_nothing(tiny_model, reference):
    _, ref = reference
    runs = _off_and_strict(tiny_model)
    (off_a, off_a_counts), (off_b, off_b_counts) = runs["off"]
    (strict_a, strict_a_counts), (strict_b, strict_b_counts) = runs["strict"]
    assert [off_a, off_b, strict_a, strict_b] == [ref] * 4
    assert off_b_counts[0] > off_a_counts[0], runs
    # strict: each request drafts from its own tokens only
    assert strict_b_counts == strict_a_counts, runs


def _multiprocess_engine_core(results, tiny_model: str) -> None:
    import os

    # the engine core in its own process: the hook tags requests there
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    prompt = _prompt()
    with engine(tiny_model, SPEC) as llm:
        results.put([gen(llm, prompt, salt) for salt in ("tenant-a", "tenant-b", "tenant-a")])


@pytest.mark.slow  # one more engine, in a process of its own
def test_tenants_are_kept_apart_with_a_multiprocess_engine_core(tiny_model, reference):
    _, ref = reference
    import multiprocessing as mp

    # a fresh process (not a pool's daemon: the engine core is its child)
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    child = spawn.Process(target=_multiprocess_engine_core, args=(results, tiny_model))
    child.start()
    try:
        (a1, fresh), (b, b_counts), (a2, a2_counts) = results.get(timeout=540)
    finally:
        child.join(60)
    assert [a1, b, a2] == [ref] * 3
    assert b_counts == fresh and a2_counts[0] > fresh[0], (fresh, b_counts, a2_counts)
