"""The sampling check of the head methods' engine tests: temperature-1
samples of one prompt, plain vs a method's trees, the first three tokens'
distributions compared by a chi-square homogeneity test."""

from __future__ import annotations

from tests.conftest import engine


def sample(llm, prompt, n, seed0, max_tokens=3):
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed0 + i,
                             ignore_eos=True) for i in range(n)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_sampling_keeps_distribution(model: str, spec: dict, text: str, n: int = 600,
                                      max_tokens: int = 3) -> dict:
    """Assert plain and ``spec`` sample the same first three tokens' laws
    (p > 1e-3 at each position; ``max_tokens`` > 3 lets later steps draft
    too); returns the method's stats."""
    from transformers import AutoTokenizer

    from tests.runner.test_tree_engine_features import _homogeneous
    from vllm_specplug.corpus import chat_ids

    prompt = chat_ids(AutoTokenizer.from_pretrained(model), text)
    # whole prompts per step: vLLM 0.32's CPU runner crashes when it discards
    # a seeded request's partial-prefill sample ("CPU Generator does not use
    # offset"), so no prompt may be split across steps
    opts = dict(max_model_len=1024, max_num_seqs=4096 // (len(prompt) + 16))
    with engine(model, **opts) as llm:
        plain = sample(llm, prompt, n, 0, max_tokens)
    with engine(model, spec, **opts) as llm:
        tree = sample(llm, prompt, n, 10_000, max_tokens)
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["tree_drafts"] > 0 and stats["accepted_tokens"] > 0, stats
    for pos in (0, 1, 2):
        p = _homogeneous([s[pos] for s in plain], [s[pos] for s in tree])
        assert p > 1e-3, (pos, p)
    return stats
