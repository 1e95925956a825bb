"""Datastores of the target's own answers to a prompt suite's prompts.

``specplug datastore build-dense --suites ...`` (DReSD's in-distribution
store) and ``specplug datastore build-sa --suites ...`` (READER's long-term
store of the target's answers) both take their prompts from
:mod:`vllm_specplug.suites` through this module: the same guard against
held-out prompts, the same selection (``skip`` / ``limit`` / prompts that fit
the context), and the same prompt list beside the store
(:mod:`vllm_specplug.datastore.prompt_list`).
"""

from __future__ import annotations

import json
import os

from vllm_specplug.datastore.dense import DatastoreError

# The context the target runs with while answering: prompt + answer must fit.
MAX_MODEL_LEN = 2048


def check_suites(names: list[str]) -> None:
    """Raise :class:`DatastoreError` naming every suite a store must not hold
    (:func:`vllm_specplug.suites.check_not_held_out`)."""
    from vllm_specplug.suites import check_not_held_out

    if not names:
        raise DatastoreError("--suites names no suite")
    try:
        check_not_held_out(names, "a datastore must not hold the answers to")
    except ValueError as e:
        raise DatastoreError(str(e)) from None


def check_out(out: str, overwrite: bool) -> None:
    """Fail before the answers are generated, not after, on a full ``out``."""
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise DatastoreError(f"output folder {out} is not empty (use --overwrite)")


def suite_prompts(names: list[str], tokenizer, *, skip: int = 0, limit: int | None = None,
                  max_new_tokens: int = 256) -> tuple[list[list[int]], list[str]]:
    """Chat-formatted prompt ids and their texts: each suite without its
    first ``skip`` prompts, then its first ``limit`` that leave room for
    ``max_new_tokens`` in :data:`MAX_MODEL_LEN`."""
    from vllm_specplug import suites

    check_suites(names)
    ids: list[list[int]] = []
    texts: list[str] = []
    for name in names:
        try:
            suite = suites.load(name)
        except (suites.SuiteUnavailable, ValueError) as e:
            raise DatastoreError(str(e)) from None
        suite.texts = suite.texts[skip:]
        suites.tokenize(suite, tokenizer, limit, MAX_MODEL_LEN - max_new_tokens)
        ids += suite.prompts
        texts += suite.used_texts
    if not ids:
        raise DatastoreError(f"no prompts left in {', '.join(names)} (--skip/--limit)")
    return ids, texts


def write_prompts(path: str, model: str, names: list[str], *, skip: int = 0,
                  limit: int | None = None, max_new_tokens: int = 128) -> list[str]:
    """A prompt file (``{"prompt": ...}`` per line, what ``build_dense_datastore``
    answers in ``in_distribution``) of the suites' prompts; returns their texts."""
    from transformers import AutoTokenizer

    _, texts = suite_prompts(names, AutoTokenizer.from_pretrained(model), skip=skip,
                             limit=limit, max_new_tokens=max_new_tokens)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"prompt": t}) + "\n")
    return texts


def target_answers(model: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answers (vLLM, plain decoding, float32)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_specplug.config import TOOL_KV_CACHE_BYTES

    llm = LLM(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0,
              enforce_eager=True, max_num_seqs=16, kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_new_tokens),
                        use_tqdm=True)
    return [list(o.outputs[0].token_ids) for o in outs]


def answers_corpus(model: str, out: str, names: list[str], *, skip: int = 0,
                   limit: int | None = None, max_new_tokens: int = 256) -> tuple[str, list[str]]:
    """Write the target's answers to the suites' prompts beside ``out``
    (``<out>.answers.jsonl``, one ``{"text": answer}`` per line); returns
    that corpus file and the prompt texts answered."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts, texts = suite_prompts(names, tok, skip=skip, limit=limit,
                                   max_new_tokens=max_new_tokens)
    answers = target_answers(model, prompts, max_new_tokens)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    corpus = out.rstrip("/") + ".answers.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for a in answers:
            f.write(json.dumps({"text": tok.decode(a, skip_special_tokens=True)}) + "\n")
    return corpus, texts
