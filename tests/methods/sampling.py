"""The sampling check of the method engine tests: temperature-1 samples of
one prompt through a method's trees, fitted to the target's own laws.

One engine per method. It samples ``n`` short continuations of the prompt
with trees pinned on (every step verifies the method's tree), then reads
the target's exact law of each of the samples' tokens from Hugging Face's
implementation of the same weights (no draft, no vLLM code). The tokens at positions 1.. are the ones tree verification
produced; ``rank_fit`` tests their ranks in their own laws (chi-square).
Exact laws instead of a second, plain sample: no reference noise, one engine
start instead of two, and 200 samples catch a tree rule that favours likely
tokens (tests/methods/test_sampling_check.py runs the statistic at this
size on simulated laws, a correct sampler and skewed ones).
"""

from __future__ import annotations

import pytest

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


def token_laws(model: str, prompt: list[int], samples: list[list[int]], positions) -> tuple:
    """``(tokens, laws)``: each sample's token at ``positions`` and the
    target's law of it after ``prompt`` + the sample's earlier tokens
    (``{token: p}``, the ``TOP_LOGPROBS`` likeliest).

    Read from Hugging Face's own implementation of the model in float32, not
    from vLLM: a reference outside the code under test, and cheap (the prompt
    runs once; its cache is shared by every sample's few tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    last = max(positions)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(samples))
        ids = torch.tensor([s[:last] for s in samples])
        at = torch.arange(len(prompt), len(prompt) + last).expand(len(samples), -1)
        logits = hf(ids, past_key_values=cache, position_ids=at).logits  # [n, last, vocab]
        probs = torch.softmax(logits[:, [pos - 1 for pos in positions]], dim=-1)
        top_p, top_t = probs.topk(TOP_LOGPROBS, dim=-1)
    tokens, laws = [], []
    for i, s in enumerate(samples):
        for j, pos in enumerate(positions):
            tokens.append(s[pos])
            laws.append(dict(zip(top_t[i, j].tolist(), top_p[i, j].tolist())))
    return tokens, laws


SHARED_ENGINE = dict(max_model_len=1024, max_num_seqs=64, block_size=32)
"""Engine options under which a method module's greedy checks and its
sampling check share one engine (``check_sampling_on``): 64 requests of at
most ``MAX_SAMPLE_PROMPT`` tokens fit vLLM's CPU default of 4096 tokens a
step, so no sampled prompt is split; blocks of 32 let later waves of samples
reuse the prompt's cached KV (vLLM's CPU default of 128 exceeds it)."""
MAX_SAMPLE_PROMPT = 4096 // 64 - 16


class OneEngine:
    """Base of a method module's ``TestOneEngine``: its greedy and sampling
    checks through one engine (``llm``, ``SHARED_ENGINE`` plus ``options``),
    opened after the fixture named ``baseline`` (whose engine must be gone
    first) and closed before the module's other engine tests (an engine's
    teardown resets the process's parallel groups, which an open engine
    still uses)."""

    spec: dict = {}
    options: dict = {}
    baseline = "baseline"

    def engine_spec(self, request) -> dict:
        """The speculative config (a subclass may read other fixtures)."""
        return self.spec

    @pytest.fixture(scope="class")
    def llm(self, request, ref_model):
        request.getfixturevalue(self.baseline)
        with engine(ref_model, self.engine_spec(request), **self.options,
                    **SHARED_ENGINE) as llm:
            yield llm


def check_sampling_keeps_distribution(model: str, spec: dict, text: str, n: int = SAMPLES,
                                      max_tokens: int = 3) -> dict:
    """Assert the tokens ``spec``'s trees verified (positions 1 ..
    ``max_tokens - 1``) follow the target's laws (p > ``ALPHA``), in an
    engine of its own; returns the method's stats."""
    # Trees pinned on: the check is of the verification rule, so every step
    # verifies a tree (the cost-aware cut may rightly draft nothing here).
    spec = {**spec, "cost_aware": False}
    with engine(model, spec, **SHARED_ENGINE) as llm:
        return check_sampling_on(llm, spec, model, text, n, max_tokens)


def check_sampling_on(llm, spec: dict, model: str, text: str, n: int = SAMPLES,
                      max_tokens: int = 3) -> dict:
    """The same check through an open engine started with ``spec`` and
    ``SHARED_ENGINE``'s options; returns what the method's stats gained
    during the check (every number as its growth)."""
    from transformers import AutoTokenizer

    from vllm_specplug.corpus import chat_ids

    assert spec.get("cost_aware") is False, "the sampling check needs the tree size pinned"
    prompt = chat_ids(AutoTokenizer.from_pretrained(model), text)
    # whole prompts per step: vLLM 0.32's CPU runner crashes when it discards
    # a seeded request's partial-prefill sample ("CPU Generator does not use
    # offset"), so no prompt may be split across steps
    assert len(prompt) <= MAX_SAMPLE_PROMPT, len(prompt)
    positions = range(1, max_tokens)
    before = llm.collective_rpc("specplug_stats")[0]
    samples = sample(llm, prompt, n, 10_000, max_tokens)
    stats = _gained(before, llm.collective_rpc("specplug_stats")[0])
    tokens, laws = token_laws(model, prompt, samples, positions)
    assert stats["tree_drafts"] > 0 and stats["accepted_tokens"] > 0, stats
    fit: Fit = rank_fit(tokens, laws)
    assert fit.tested == n * len(positions), fit
    assert fit.pvalue > ALPHA, (fit, fit.pvalue)
    return stats


def _gained(before: dict, after: dict) -> dict:
    """``after`` with every number that grew since ``before`` replaced by
    its growth (nested dicts too); other values as ``after`` has them."""
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            out[key] = _gained(old, value)
        elif isinstance(value, (int, float)) and isinstance(old, (int, float)) \
                and not isinstance(value, bool):
            out[key] = value - old
        else:
            out[key] = value
    return out
