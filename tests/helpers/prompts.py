"""Prompts of the engine tests on the reference model."""

from __future__ import annotations

import json

COPY_MAX_TOKENS = 48
"""Tokens generated per prompt in the greedy checks on ``copy_prompts``."""

SPEC_BENCH_MAX_TOKENS = 24
"""Tokens generated per prompt in the greedy checks on ``spec_bench_prompts``."""

PREAMBLE = ("You are a careful assistant. Answer step by step, keep the answer short, "
            "and show the arithmetic when there is any. ") * 8
"""A shared system-style preamble longer than a CPU KV block (128 tokens), so
prefix caching serves whole blocks and a head's prefix store is used."""


def copy_prompts(model: str, n: int, max_len: int = 500) -> list[list[int]]:
    """Chat-formatted Spec-Bench summarization/RAG prompts under ``max_len``
    tokens (plenty for a model-free method to copy; prefill is most of what
    a greedy check on them costs, so they are kept short)."""
    from transformers import AutoTokenizer

    from vllm_specplug.suites import shared_dir

    tok = AutoTokenizer.from_pretrained(model)
    path = shared_dir() / "data/spec_bench/question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if r["category"] in ("summarization", "rag")]
    out = []
    for r in rows:
        text = tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}],
                                       add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) < max_len:
            out.append(ids)
        if len(out) == n:
            break
    return out


def spec_bench_prompts(model: str, n: int, preamble: str = "") -> list[list[int]]:
    """``n`` chat-formatted Spec-Bench prompts spread over writing, math,
    coding and STEM, each after ``preamble``."""
    from transformers import AutoTokenizer

    from vllm_specplug.corpus import chat_ids
    from vllm_specplug.eagle3.prompts import spec_bench_path

    tok = AutoTokenizer.from_pretrained(model)
    with open(spec_bench_path(), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    cats = ("writing", "math_reasoning", "coding", "stem")
    picked = [r for c in cats for r in rows if r["category"] == c][::9][:n]
    return [chat_ids(tok, preamble + r["turns"][0]) for r in picked]
