"""Generate with a specplug method on the reference model, beside plain decoding.

    python examples/offline_generate.py [--method pld] [--spec '{"tree_branches": 3}']

Prints tokens/s of plain decoding and of the method, the method's mean
accepted length (from vLLM's own counters), and whether the outputs are
identical (float32 greedy: they must be).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [
    "Summarize this: The quick brown fox jumps over the lazy dog. The dog sleeps "
    "while the fox runs around the farm. The farmer sees the fox and the dog.",
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "List the planets of the solar system in order, one per line, with one fact each.",
    "Repeat the following sentence three times: specplug makes vLLM faster on CPU.",
]


def run(model: str, spec: dict | None, prompts, max_tokens: int, dtype: str):
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0,
              speculative_config=spec, disable_log_stats=False)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(chats[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    text = outs[0].outputs[0].text
    mal = None
    if spec is not None:
        c = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        drafts = c.get("vllm:spec_decode_num_drafts") or 0
        acc = c.get("vllm:spec_decode_num_accepted_tokens") or 0
        mal = 1 + acc / drafts if drafts else 1.0
    # Shut down now: left to GC, a dead in-process engine tears down the
    # next engine's distributed state.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return tokens, sum(map(len, tokens)) / dt, mal, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the reference model")
    ap.add_argument("--method", default="pld")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--spec", default="{}", help="extra method options (JSON)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from vllm_specplug.models.reference import reference_model_path

    model = args.model or reference_model_path()
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
            **json.loads(args.spec)}
    base, base_tps, _, _ = run(model, None, PROMPTS, args.max_tokens, args.dtype)
    got, tps, mal, text = run(model, spec, PROMPTS, args.max_tokens, args.dtype)
    print(f"\nmodel: {model}\nprompts: {len(PROMPTS)} (batch), max_tokens {args.max_tokens}, "
          f"dtype {args.dtype}")
    print(f"{'plain decoding':<28}{base_tps:8.1f} tok/s")
    print(f"{args.method + ' ' + json.dumps(spec):<28}{tps:8.1f} tok/s  "
          f"x{tps / base_tps:.2f}  mean accepted length {mal:.2f}")
    same = sum(a == b for a, b in zip(base, got))
    print(f"identical outputs: {same}/{len(base)}")
    print(f"\nfirst answer:\n{text}")


if __name__ == "__main__":
    main()
