"""Tree verification under the engine features a server uses: prefix
caching, chunked prefill, preemption, logprobs; and the sampling
distribution end to end."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import engine, greedy
from tests.helpers.sampling_stats import homogeneity_pvalue

pytestmark = pytest.mark.engine

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in
               [300, 250, 40, 129, 7, 33, 200, 95] * 3]
    with engine(tiny_model) as llm:
        outs = greedy(llm, prompts, MAX_TOKENS)
    path = tmp_path_factory.mktemp("oracle") / "ref.json"
    path.write_text(json.dumps([p + o for p, o in zip(prompts, outs)]))
    return prompts, outs, str(path)


def _spec(ref_file: str) -> dict:
    return {"method": "oracle", "num_speculative_tokens": 10,
            "reference_file": ref_file, "max_depth": 5}


def test_prefix_caching_and_chunked_prefill(tiny_model, reference):
    prompts, outs, ref_file = reference
    with engine(tiny_model, _spec(ref_file), enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=128) as llm:
        assert greedy(llm, prompts, MAX_TOKENS) == outs
        # Second pass: the prompts' blocks come from the prefix cache.
        assert greedy(llm, prompts, MAX_TOKENS) == outs
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["accepted_tokens"] == stats["method"]["expected_accepted"]
    assert stats["drafts"] == stats["method"]["drafts"]
    assert stats["kv_moves"] > 0


def test_preemption(tiny_model, reference):
    prompts, outs, ref_file = reference
    # 10 blocks of KV (128 tokens each on CPU) for 24 requests of up to 340
    # tokens: the scheduler has to preempt and recompute. How often varies
    # between identical runs: 12 blocks can give no preemption at all, 10
    # give several.
    with engine(tiny_model, _spec(ref_file),
                num_gpu_blocks_override=10) as llm:
        got = greedy(llm, prompts, MAX_TOKENS)
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["preempted"] > 0
    assert got == outs


@pytest.mark.parametrize("tree_size", [10, 1], ids=["trees", "chains"])
def test_greedy_verdicts_skip_vllms_sampler_only_where_exact(tiny_model, reference,
                                                            monkeypatch, tree_size):
    """All-greedy tree and chain steps take vLLM's verdict from the host
    (``engine/verify.greedy_output``) and never run its rejection sampler;
    asking for logprobs sends every drafted step through it. Plain
    decoding's tokens either way."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    calls = []
    forward = RejectionSampler.forward

    def counted(self, *a, **k):
        calls.append(1)
        return forward(self, *a, **k)

    monkeypatch.setattr(RejectionSampler, "forward", counted)
    prompts, outs, ref_file = reference
    # the first 8 prompts: every length once, several requests' trees a
    # step; the other 16 repeat the lengths, for the preemption test
    prompts, outs = prompts[:8], outs[:8]
    with engine(tiny_model, {**_spec(ref_file), "tree_size": tree_size}) as llm:
        assert greedy(llm, prompts, MAX_TOKENS) == outs
        assert not calls
        drafted = llm.collective_rpc("specplug_stats")[0]["drafts"]
        assert greedy(llm, prompts[:4], MAX_TOKENS, logprobs=2) == outs[:4]
        assert calls
        assert llm.collective_rpc("specplug_stats")[0]["drafts"] > drafted > 0


def _sample(llm, prompt, n, seed0, max_tokens=3):
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed0 + i,
                             ignore_eos=True) for i in range(n)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_sampling_keeps_target_distribution(tiny_model, tmp_path):
    """Temperature 1 on the tiny model: with trees built from earlier samples
    (realistic sibling sets), the tokens verified through the trees follow
    the same distribution as plain sampling."""
    prompt, n = [11, 42, 7, 99, 3], 1200
    with engine(tiny_model) as llm:
        seen = _sample(llm, prompt, n, 0)
        plain = _sample(llm, prompt, n, 10_000)
    ref = tmp_path / "samples.json"
    ref.write_text(json.dumps([prompt + s for s in seen]))
    spec = {"method": "oracle", "num_speculative_tokens": 8, "reference_file": str(ref),
            "mode": "trie", "max_depth": 2}
    with engine(tiny_model, spec) as llm:
        tree = _sample(llm, prompt, n, 20_000)
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["tree_drafts"] > 0 and stats["accepted_tokens"] > 0
    for pos in (1, 2):
        p = homogeneity_pvalue([s[pos] for s in plain], [s[pos] for s in tree])
        assert p > 1e-3, (pos, p)


def test_a_request_near_max_model_len_does_not_stop_the_others_drafting(tiny_model, tmp_path):
    """vLLM drafts for no request once the batch's longest sequence is
    within num_speculative_tokens of max_model_len. The runner cuts each
    request's tree to its own room instead, so a request drafts (and is
    accepted) the same alone as beside a long one, and the long one drafts
    right up to the limit, losslessly."""
    rng = random.Random(3)
    long = [rng.randrange(3, 500) for _ in range(118)]
    short = [rng.randrange(3, 500) for _ in range(9)]
    max_len, new = 128, 9  # the long request ends at 127 tokens
    with engine(tiny_model, max_model_len=max_len) as llm:
        plain = greedy(llm, [long, short], new)
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps([p + o for p, o in zip([long, short], plain)]))

    def accepted(llm, prompts):
        before = llm.collective_rpc("specplug_stats")[0]["accepted_tokens"]
        outs = greedy(llm, prompts, new)
        return outs, llm.collective_rpc("specplug_stats")[0]["accepted_tokens"] - before

    # trie: the true continuation to depth 5, the same whatever the batch
    spec = {**_spec(str(ref)), "mode": "trie"}
    with engine(tiny_model, spec, max_model_len=max_len) as llm:
        short_alone = accepted(llm, [short])
        long_alone = accepted(llm, [long])
        both = accepted(llm, [long, short])
    assert short_alone[0] == [plain[1]] and long_alone[0] == [plain[0]]
    assert both[0] == plain
    # 9 tokens, trees of depth 5: 5 accepted, then the last 2 of 3
    assert short_alone[1] == long_alone[1] == 7
    assert both[1] == short_alone[1] + long_alone[1]
