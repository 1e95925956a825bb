"""The sampling check of the method engine tests: temperature-1 samples of
one prompt through a method's trees, fitted to the target's own laws.

One engine per method. It samples ``n`` short continuations of the prompt
with trees pinned on (every step verifies the method's tree), then reads
back, for every sample, the target's exact law of each of its tokens
(``prompt_logprobs`` of the sample as a prompt: prefill only, which no draft
touches). The tokens at positions 1.. are the ones tree verification
produced; ``rank_fit`` tests their ranks in their own laws (chi-square).
Exact laws instead of a second, plain sample: no reference noise, one engine
start instead of two, and 200 samples catch a tree rule that favours likely
tokens (tests/methods/test_sampling_check.py runs the statistic at this
size on simulated laws, a correct sampler and skewed ones).
"""

from __future__ import annotations

import math

from tests.conftest import engine
from tests.helpers.sampling_stats import Fit, rank_fit

SAMPLES = 200
"""Samples per method."""
TOP_LOGPROBS = 20
"""Likeliest tokens read per law (vLLM's default cap; ``rank_fit`` uses the
first few ranks)."""
ALPHA = 1e-3
"""The check fails below this p-value."""


def sample(llm, prompt, n, seed0, max_tokens=3):
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed0 + i,
                             ignore_eos=True) for i in range(n)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def token_laws(llm, prompt: list[int], samples: list[list[int]], positions) -> tuple:
    """``(tokens, laws)``: each sample's token at ``positions`` and the
    target's law of it after ``prompt`` + the sample's earlier tokens
    (``{token: p}``, the ``TOP_LOGPROBS`` likeliest and the token itself)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS)
    last = max(positions)
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt + s[:last + 1]) for s in samples],
                        params, use_tqdm=False)
    tokens, laws = [], []
    for s, out in zip(samples, outs):
        for pos in positions:
            law = out.prompt_logprobs[len(prompt) + pos]
            tokens.append(s[pos])
            laws.append({int(t): math.exp(lp.logprob) for t, lp in law.items()})
    return tokens, laws


def check_sampling_keeps_distribution(model: str, spec: dict, text: str, n: int = SAMPLES,
                                      max_tokens: int = 3) -> dict:
    """Assert the tokens ``spec``'s trees verified (positions 1 ..
    ``max_tokens - 1``) follow the target's laws (p > ``ALPHA``); returns
    the method's stats."""
    from transformers import AutoTokenizer

    from vllm_specplug.corpus import chat_ids

    prompt = chat_ids(AutoTokenizer.from_pretrained(model), text)
    positions = range(1, max_tokens)
    # Trees pinned on: the check is of the verification rule, so every step
    # verifies a tree (the cost-aware cut may rightly draft nothing here).
    spec = {**spec, "cost_aware": False}
    # whole prompts per step: vLLM 0.32's CPU runner crashes when it discards
    # a seeded request's partial-prefill sample ("CPU Generator does not use
    # offset"), so no prompt may be split across steps
    opts = dict(max_model_len=1024, max_num_seqs=4096 // (len(prompt) + 16))
    with engine(model, spec, **opts) as llm:
        samples = sample(llm, prompt, n, 10_000, max_tokens)
        stats = llm.collective_rpc("specplug_stats")[0]
        tokens, laws = token_laws(llm, prompt, samples, positions)
    assert stats["tree_drafts"] > 0 and stats["accepted_tokens"] > 0, stats
    fit: Fit = rank_fit(tokens, laws)
    assert fit.tested == n * len(positions), fit
    assert fit.pvalue > ALPHA, (fit, fit.pvalue)
    return stats
