"""Build the suffix-array datastore a benchmark run measures ``reader`` with.

    python -m benchmarks.reader_store \\
        --suites humaneval:even,specbench:qa,specbench:translation --skip 16 \\
        --out ~/.cache/vllm_specplug/reader-sa

READER's long-term store holds answers of the target itself (the paper: 100
responses not used for the metric). Here: the target's greedy answers
(vLLM, plain decoding, float32) to prompts that are never evaluated --
``humaneval:even`` (the benchmark measures ``humaneval:odd``) and the
Spec-Bench categories the READER comparison does not measure (``qa``,
``translation``), each without its first ``--skip`` prompts (default 16):
issue 21's matrix measures every Spec-Bench category on its first 8
(batch 1) or 16 (batch 8) prompts, and a store holding the answers to the
measured prompts lets ``reader`` copy them (sessions 15-16 reported a tau of
3.99 on QA that way). The prompts' hashes are written beside the store
(``<out>.prompts.json``) and ``benchmarks.run`` refuses a store that holds a
measured prompt. Never the EAGLE-3 training folder, Spec-Bench
``mt_bench``/``math_reasoning``/``summarization``/``rag``, or ShareGPT's first
10,000 conversations. The answers are kept beside the store
(``answers.jsonl``, its corpus); an existing complete store is kept
(``--overwrite`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

FORBIDDEN = ("specbench:mt_bench", "specbench:math_reasoning", "specbench:summarization",
             "specbench:rag", "specbench", "humaneval:odd", "humaneval")


def _answers(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_specplug.config import TOOL_KV_CACHE_BYTES

    llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              max_num_seqs=16, kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from benchmarks import store_prompts, suites
    from vllm_specplug.datastore.dense import DatastoreError
    from vllm_specplug.datastore.suffix_array import build_sa_datastore, open_sa_datastore
    from vllm_specplug.models.reference import reference_model_path

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="humaneval:even,specbench:qa,specbench:translation")
    ap.add_argument("--out", default="~/.cache/vllm_specplug/reader-sa")
    ap.add_argument("--model", help="target folder (default: the reference model)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, help="first N prompts of each suite (after --skip)")
    ap.add_argument("--skip", type=int, default=16,
                    help="leave out each suite's first N prompts (the ones benchmarks.run "
                         "measures with --limit up to N)")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)

    out = os.path.expanduser(args.out)
    model = args.model or reference_model_path()
    names = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = [s for s in names if s in FORBIDDEN]
    if bad:
        print(f"benchmarks.reader_store: {', '.join(bad)} are evaluated prompts; "
              "the store must not hold their answers", file=sys.stderr)
        return 1
    if os.path.exists(out) and not args.overwrite:
        try:
            store = open_sa_datastore(out, verify_checksums=False)
            if not os.path.exists(store_prompts.list_path(out)):
                print(f"{out} has no prompt list (built before --skip: it may hold the "
                      "answers to measured prompts); pass --overwrite", file=sys.stderr)
                return 1
            print(f"reader store exists: {out} ({len(store):,} tokens; --overwrite rebuilds)")
            return 0
        except DatastoreError as e:
            print(f"{out} is not a usable store ({e}); pass --overwrite", file=sys.stderr)
            return 1
    tok = AutoTokenizer.from_pretrained(model)
    prompts: list[list[int]] = []
    texts: list[str] = []
    for name in names:
        suite = suites.load(name)
        suite.texts = suite.texts[args.skip:]
        suites.tokenize(suite, tok, args.limit, 2048 - args.max_tokens)
        prompts += suite.prompts
        texts += suite.used_texts
    answers = _answers(model, prompts, args.max_tokens)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    corpus = out.rstrip("/") + ".answers.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for a in answers:
            f.write(json.dumps({"text": tok.decode(a, skip_special_tokens=True)}) + "\n")
    try:
        man = build_sa_datastore(model, out, [corpus], overwrite=args.overwrite)
    except DatastoreError as e:
        print(f"benchmarks.reader_store: {e}", file=sys.stderr)
        return 1
    store_prompts.record(out, texts, names)
    print(f"reader store: {out} ({man['num_tokens']:,} tokens, {man['num_documents']} "
          f"answers of {', '.join(names)}, each without its first {args.skip} prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
