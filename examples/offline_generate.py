"""Generate with a specplug method on the reference model, beside plain decoding.

    python examples/offline_generate.py [--method pld] [--spec '{"tree_branches": 3}']

Prints, for the method:

1. tau, the tokens each request gets per target-model pass: generated /
   (generated - accepted), from vLLM's own counters (output tokens and
   ``vllm:spec_decode_num_accepted_tokens``); plain decoding's is 1;
2. its speedup over plain decoding (tokens/s of the same batch);
3. whether its outputs are identical to plain decoding's (float32 greedy:
   they must be).
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


def _counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}


def run(model: str, spec: dict | None, prompts, max_tokens: int, dtype: str):
    """Greedy answers to ``prompts`` in one batch: (token ids, tokens/s,
    tau, the first answer's text)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0,
              speculative_config=spec, disable_log_stats=False)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    # Warm-up at the same batch size: the first run of a shape pays one-time
    # costs (kernel set-up) that would otherwise count against plain decoding.
    llm.chat(chats, SamplingParams(max_tokens=4), use_tqdm=False)
    before = _counters(llm)
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    after = _counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    text = outs[0].outputs[0].text

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    generated = grew("vllm:generation_tokens")
    accepted = grew("vllm:spec_decode_num_accepted_tokens")
    tau = generated / (generated - accepted) if generated > accepted else float("nan")
    # Shut down now: left to GC, a dead in-process engine tears down the
    # next engine's distributed state.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return tokens, sum(map(len, tokens)) / dt, tau, text


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
    got, tps, tau, text = run(model, spec, PROMPTS, args.max_tokens, args.dtype)
    same = sum(a == b for a, b in zip(base, got))
    print(f"\nmodel: {model}\n{len(PROMPTS)} prompts in one batch, max_tokens "
          f"{args.max_tokens}, {args.dtype}, greedy\n")
    print(f"speculative_config {json.dumps(spec)}")
    print(f"  {'tau (tokens per target pass, per request)':<44}{tau:.2f}")
    print(f"  {'speedup over plain decoding':<44}{tps / base_tps:.2f}x  "
          f"({tps:.1f} vs {base_tps:.1f} tokens/s)")
    print(f"  {'outputs identical to plain decoding':<44}{same}/{len(base)}")
    print(f"\nfirst answer:\n{text}")


if __name__ == "__main__":
    main()
