"""Cost of one verification step vs draft-tree size.

    python -m benchmarks.verify_cost [--sizes 0,1,2,4,8,16,32,64] [--batch 1,8,32]
        [--steps 16] [--dtype bfloat16] [--eager] [--prompt-tokens 100]
        [--out verify_cost.json --plot verify_cost.png]

For each batch size B and tree size S, B requests of a 100-token prompt
(``--prompt-tokens``: the CPU tree rows read the whole context, so their
cost grows with it)
each verify random trees of exactly S nodes (the `oracle` method in `noise`
mode: nothing is accepted, so every step is one target forward over
B * (S + 1) tokens plus tree attention, sampling and the draft hand-over).
Step time = (time for 1 + steps tokens - time for 1 token) / steps, so the
prefill is left out. S = 0 is plain decoding (vLLM's own; ``--plugin-plain`` adds plain decoding
through the plugin's engine, which has its own CPU linear kernel, so that
the trees' own cost can be told from the kernel's gain). Each configuration runs in its
own process; plain decoding's engine stays up beside each tree size's and
the two are timed in turn ``--repeats`` times: ``relative_to_plain`` is the
median of those side-by-side ratios (the machine's speed drifts between
minutes), ``step_ms`` the median step. Methods size their trees from this
curve.

The engines run compiled, as users get them (``--eager``: vLLM's eager
mode). Compiled engines share vLLM's compile cache (``VLLM_CACHE_ROOT``), so
each engine configuration compiles once, on its first start ever.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from statistics import median

from benchmarks import result_file
from benchmarks.figures import save_png


def _engine(conn, model: str, dtype: str, batch: int, size: int, steps: int,
            eager: bool = False, prompt_tokens: int = 100, plugin: bool = False) -> None:
    """One engine in its own process, timing ``steps`` decode steps each
    time the parent sends ``"time"`` (answers seconds per step), until
    ``"stop"``. ``plugin`` with size 0: plain decoding through the plugin's
    engine (the oracle drafting nothing)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_specplug.config import TOOL_KV_CACHE_BYTES

    spec = None
    if size:
        spec = {"method": "oracle", "mode": "noise", "num_speculative_tokens": size,
                "tree_size": size}
    elif plugin:
        spec = {"method": "oracle", "mode": "none", "num_speculative_tokens": 1}
    max_len = max(512, prompt_tokens + steps + size + 64)
    llm = LLM(model=model, dtype=dtype, max_model_len=max_len, enforce_eager=eager, seed=0,
              speculative_config=spec, max_num_seqs=max(batch, 1), kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES,
              max_num_batched_tokens=max(2048, batch * (size + 1) + 256))
    prompts = [TokensPrompt(prompt_token_ids=[(17 * i + 7 * j) % 4000 + 100
                                              for j in range(prompt_tokens)])
               for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up
    conn.send("ready")
    while conn.recv() == "time":
        # the other engine's OpenMP threads spin for a while after its last
        # step (both cores): let them go to sleep before the clock starts
        time.sleep(1.0)
        t1 = run(1)
        tn = run(1 + steps)
        conn.send((tn - t1) / steps)
    llm.llm_engine.engine_core.shutdown()


class _Engine:
    """The parent's handle on one ``_engine`` process."""

    def __init__(self, ctx, *args) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine, args=(child, *args), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("verify_cost: engine failed to start")

    def time(self) -> float:
        self.conn.send("time")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default="0,1,2,4,8,16,32,64")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16,
                    help="timed steps per point, fewer for big points (default 16)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true",
                    help="vLLM's eager mode instead of the compiled model (the default)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="side-by-side timings of each tree size and plain decoding "
                         "(default 5; the ratio is their median)")
    ap.add_argument("--prompt-tokens", type=int, default=100,
                    help="context of every request before the timed steps (default 100)")
    ap.add_argument("--plugin-plain", action="store_true",
                    help="also time plain decoding through the plugin's engine (its runner "
                         "and CPU kernels, no trees) in each round; records get "
                         "relative_to_plugin_plain: what the trees alone cost")
    ap.add_argument("--out", default="verify_cost.json")
    ap.add_argument("--plot", default="verify_cost.png")
    args = ap.parse_args()
    from vllm_specplug.models.reference import reference_model_path

    model = args.model or reference_model_path()
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    from benchmarks.machine import describe, git_info, machine_info
    from benchmarks.run import cpu_linear_run

    machine = machine_info()
    print(describe(machine), f"({'eager' if args.eager else 'compiled'})", flush=True)
    records = []
    ctx = mp.get_context("spawn")
    t_start = time.time()
    for b in batches:
        # The machine's speed drifts by 10-15 % over minutes (other tenants
        # of the host): a tree size timed in its own engine minutes after
        # plain decoding's gave 1.55x and 2.1x for the same code. So plain
        # decoding's engine stays up while each tree size's engine is
        # timed in turn with it, `repeats` times, and the ratio is the
        # median of those side-by-side pairs.
        plain_steps = max(3, min(args.steps, 4096 // b))
        plain = _Engine(ctx, model, args.dtype, b, 0, plain_steps, args.eager,
                        args.prompt_tokens)
        pplain = None
        if args.plugin_plain:
            pplain = _Engine(ctx, model, args.dtype, b, 0, plain_steps, args.eager,
                             args.prompt_tokens, True)
        for s in sizes:
            # small steps are noisy, big ones slow: about 4k verified tokens per point
            n_steps = max(3, min(args.steps, 4096 // (b * (s + 1))))
            eng = None if s == 0 else _Engine(ctx, model, args.dtype, b, s, n_steps,
                                              args.eager, args.prompt_tokens)
            times, ratios, pps = [], [], []
            for _ in range(args.repeats):
                p = plain.time()
                if pplain is not None:
                    pps.append(pplain.time())
                t = p if eng is None else eng.time()
                times.append(t)
                ratios.append(t / p)
            if eng is not None:
                eng.close()
            step = median(times)
            rec = {"batch_size": b, "tree_size": s, "step_ms": step * 1000, "steps": n_steps,
                   "tokens_per_step": b * (s + 1), "repeats": args.repeats,
                   "step_ms_repeats": [round(1000 * t, 3) for t in times],
                   "relative_to_plain": median(ratios),
                   "relative_to_plain_repeats": [round(r, 4) for r in ratios]}
            extra = ""
            if pps:
                rel = [t / q for t, q in zip(times, pps)]
                rec.update(plugin_plain_step_ms=median(pps) * 1000,
                           plugin_plain_step_ms_repeats=[round(1000 * q, 3) for q in pps],
                           relative_to_plugin_plain=median(rel),
                           relative_to_plugin_plain_repeats=[round(r, 4) for r in rel])
                extra = (f"; plain through the plugin {median(pps) * 1000:.1f} ms, "
                         f"{rec['relative_to_plugin_plain']:.2f}x that")
            records.append(rec)
            print(f"batch {b:3d}  tree {s:3d}  step {step * 1000:9.1f} ms  "
                  f"{rec['relative_to_plain']:.2f}x plain (median of {args.repeats} pairs: "
                  + ", ".join(f"{r:.2f}" for r in ratios) + ")" + extra, flush=True)
        plain.close()
        if pplain is not None:
            pplain.close()
    meta = {"model": model, "dtype": args.dtype, "steps": args.steps, "repeats": args.repeats,
            "prompt_tokens": args.prompt_tokens,
            "enforce_eager": args.eager, "machine": machine, "git": git_info(),
            "cpu_linear": cpu_linear_run(), "seconds": time.time() - t_start}
    result_file.write({"meta": meta, "records": records}, args.out)
    _plot(records, args.plot, meta)
    print(f"wrote {args.out} and {args.plot}")


def _plot(records, path, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for b in sorted({r["batch_size"] for r in records}):
        rs = [r for r in records if r["batch_size"] == b]
        ax.plot([max(r["tree_size"], 0.5) for r in rs], [r["relative_to_plain"] for r in rs],
                marker="o", label=f"batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft tree size (nodes; 0.5 = plain decoding)")
    ax.set_ylabel("step time / plain decoding step")
    mode = "eager" if meta.get("enforce_eager", True) else "compiled"
    ax.set_title(f"Verification cost, {os.path.basename(meta['model'])} {meta['dtype']} "
                 f"({mode}, {meta.get('prompt_tokens', 100)}-token context)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=120)


if __name__ == "__main__":
    main()
