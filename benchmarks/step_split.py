"""Where one engine's decode step goes: the target's forward against the rest.

    python -m benchmarks.step_split --spec none --suites humaneval:odd,specbench:qa
    python -m benchmarks.step_split --spec '{"method": "oracle", "mode": "none"}' ...

Starts one engine (compiled, float32, in this process), runs each suite's
first ``--limit`` prompts at ``--batch`` ``--repeats`` times (prefix cache
reset between) and prints, per run, the wall time and the median decode
step split into the target's forward (vLLM's ``_model_forward``) and
everything else in the engine step (scheduling, input preparation, logits,
sampling, a method's drafting and verification). Run it for plain decoding
and for a method, one engine after another, several times each: engines of
the same configuration differ in forward time by several per cent (session
25: +-5-8 % on a 2-core Xeon), so a method's own overhead is its "rest"
against plain decoding's, read over several engines, not one wall time.

The two timers wrap vLLM methods from outside (measurement only; nothing
else here touches vLLM's internals). Compare figures from one machine and
one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process


def _timed(cls, name: str, sink: list[float]) -> None:
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="none",
                    help="'none' (plain decoding) or a speculative_config as JSON")
    ap.add_argument("--suites", default="humaneval:odd,specbench:qa,specbench:translation")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1360)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-steps", type=int, default=3,
                    help="first steps of each run left out of the medians (prefill)")
    args = ap.parse_args(argv)
    spec = None if args.spec == "none" else json.loads(args.spec)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from benchmarks import suites as suites_mod
    from benchmarks.machine import machine_info
    from vllm_specplug.models.reference import reference_model_path

    model = reference_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    max_prompt = args.max_model_len - args.max_tokens - 32
    suites = [suites_mod.tokenize(suites_mod.load(s.strip()), tok, args.limit, max_prompt)
              for s in args.suites.split(",") if s.strip()]
    fwd: list[float] = []
    step: list[float] = []
    _timed(GPUModelRunner, "_model_forward", fwd)
    _timed(EngineCore, "step", step)
    llm = LLM(model=model, dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=args.batch, seed=0, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = suites[0].prompts[: args.batch]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm],
                 SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    rows = []
    for s in suites:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in s.prompts]
        for r in range(args.repeats):
            llm.reset_prefix_cache()
            fwd.clear()
            step.clear()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            f, st = fwd[args.skip_steps:] or fwd, step[args.skip_steps:] or step
            mf, ms = statistics.median(f) * 1e3, statistics.median(st) * 1e3
            rows.append({"suite": s.name, "repeat": r, "wall_s": round(wall, 3),
                         "steps": len(step), "forward_ms": round(mf, 2),
                         "rest_ms": round(ms - mf, 2)})
            print(f"{args.spec[:40]:40s} {s.name:24s} r{r} wall {wall:6.2f} s  "
                  f"step {ms:6.1f} ms = forward {mf:6.1f} + rest {ms - mf:5.1f}", flush=True)
    print(json.dumps({"spec": spec, "batch": args.batch, "machine": machine_info(),
                      "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
