"""The EAGLE-3 head shipped for the reference model, run by vLLM's own
``eagle3`` (not specplug's runner): it loads, it is the default head when
``model`` is left out, it drafts tokens the target accepts, and the output is
token-identical to plain decoding (float32) at batch 1 and 8."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import engine, greedy, run_isolated, spec_counters

MAX_TOKENS = 48


def _prompts(model: str, n: int) -> list[list[int]]:
    """Chat-rendered MT-bench and math prompts (held out of the head's data)."""
    from transformers import AutoTokenizer

    from vllm_specplug.corpus import chat_ids
    from vllm_specplug.eagle3.prompts import spec_bench_path

    tok = AutoTokenizer.from_pretrained(model)
    with open(spec_bench_path(), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    cats = ("writing", "math_reasoning", "coding", "stem")
    picked = [r for c in cats for r in rows if r["category"] == c][::9][:n]
    return [chat_ids(tok, r["turns"][0]) for r in picked]


def _run(model: str, prompts: list[list[int]]) -> dict:
    res = {}
    with engine(model) as llm:
        res["base"] = greedy(llm, prompts, MAX_TOKENS)
    # no "model": the plugin fills in the shipped head for this target
    with engine(model, {"method": "eagle3", "num_speculative_tokens": 4}) as llm:
        res["b1"] = greedy(llm, prompts[:1], MAX_TOKENS)
        res["b8"] = greedy(llm, prompts, MAX_TOKENS)
        res["counters"] = spec_counters(llm)
    return res


def test_default_head_is_found_for_the_reference_model(ref_model, tmp_path):
    from vllm_specplug.eagle3 import default_head_for, shipped_head_path

    assert default_head_for(ref_model) == shipped_head_path()
    cfg = json.load(open(os.path.join(ref_model, "config.json")))
    cfg["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert default_head_for(str(tmp_path)) is None
    assert os.path.getsize(os.path.join(shipped_head_path(), "model.safetensors")) < 30 << 20


def test_eagle3_without_head_for_unknown_model_is_a_clear_error(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_specplug.plugin as plugin

    plugin.register()
    args = EngineArgs(model=tiny_model, speculative_config={"method": "eagle3",
                                                            "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="ships no head"):
        args.create_engine_config()


@pytest.mark.slow  # default-suite time budget (30 min)
@pytest.mark.engine
def test_shipped_head_lossless_and_accepting(ref_model):
    prompts = _prompts(ref_model, 8)
    assert len(prompts) == 8
    res = run_isolated(_run, ref_model, prompts)
    assert res["b1"] == res["base"][:1]
    assert res["b8"] == res["base"]
    c = res["counters"]
    assert c["drafts"] > 0
    # a trained head: well above the ~0 acceptance of a random one
    mean_accepted = 1 + c["accepted_tokens"] / c["drafts"]
    assert mean_accepted > 1.3, c
