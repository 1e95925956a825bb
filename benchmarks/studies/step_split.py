"""Where one engine's decode step goes: the target's forward against the rest.

    python -m benchmarks.studies.step_split --spec none --suites humaneval:odd,specbench:qa
    python -m benchmarks.studies.step_split --spec '{"method": "oracle", "mode": "none"}' ...

Starts one engine (compiled, float32, in this process), runs each suite's
first ``--limit`` prompts at ``--batch`` ``--repeats`` times (prefix cache
reset between) and prints, per run, the wall time and the median decode
step split into the target's forward (vLLM's ``_model_forward``) and
everything else in the engine step (scheduling, input preparation, logits,
sampling, a method's drafting and verification). Run it for plain decoding
and for a method, one engine after another, several times each: engines of
the same configuration differ in forward time by several per cent (+-5-8 %
on a 2-core machine), so a method's own overhead is its "rest"
against plain decoding's, read over several engines, not one wall time.

``--by-rows`` also times the runner's parts in every step (vLLM's
``_update_states``, ``_prepare_inputs``, ``_model_forward``, ``_sample``,
``propose_draft_token_ids``, ``_bookkeeping_sync``; a specplug method's
overrides included) and prints their medians per number of scheduled rows:
what a step of ``r`` rows costs with this method, drafting included.
``--sync`` runs plain decoding without async scheduling, as speculation
runs, so that ``--spec '{"method": "oracle", "mode": "none"}'`` against
``--spec none --sync`` isolates what the plugin adds to a step that drafts
nothing (a fraction of a millisecond per 1-row step, spread over sampling,
input preparation and the drafting hook).

The timers wrap vLLM methods from outside (measurement only; nothing
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

from benchmarks import result_file

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
# vLLM's CPU default sizes the KV cache from the machine's memory (over 12 GiB
# here); 2 GiB holds these batches, as in benchmarks.run
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _timed(cls, name: str, record, before=None) -> None:
    """Wrap ``cls.name``: ``record(seconds)`` after every call, and
    ``before(args)`` ahead of it when given."""
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        if before is not None:
            before(args)
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            record(time.perf_counter() - t)

    setattr(cls, name, wrapper)


PARTS = ("_update_states", "_prepare_inputs", "_model_forward", "_sample",
         "propose_draft_token_ids", "_bookkeeping_sync")
"""Runner methods timed per step with ``--by-rows`` (a specplug method's
mixin overrides included: they are wrapped on the class vLLM builds)."""


def _install_part_timers(spec) -> list[dict]:
    """Per engine step: its scheduled rows, whether it only decoded, and the
    seconds of each of ``PARTS``, of the runner's ``execute_model`` +
    ``sample_tokens`` and of the whole engine-core step (scheduling and
    output hand-over included)."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from vllm_specplug import registry

    cls = CPUModelRunner
    if spec is not None and registry.is_registered(spec.get("method", "")):
        from vllm_specplug.runner.cpu_worker import SpecplugCPUModelRunner

        cls = SpecplugCPUModelRunner
    steps: list[dict] = []
    cur: dict = {}

    def add(name):
        return lambda seconds: cur.__setitem__(name, cur.get(name, 0.0) + seconds)

    def scheduled(args) -> None:
        so = args[0]
        cur["rows"] = so.total_num_scheduled_tokens
        # decode only: every request runs its last token plus its drafts
        # (a prompt chunk schedules more; a batch with drafts may exceed
        # any fixed row count, so no threshold tells the two apart)
        drafts = sum(len(t) for t in so.scheduled_spec_decode_tokens.values())
        cur["decode"] = (not so.scheduled_new_reqs and so.total_num_scheduled_tokens
                         == len(so.num_scheduled_tokens) + drafts)

    def finish(seconds) -> None:
        cur["step"] = seconds
        if "rows" in cur:
            steps.append(dict(cur))

    for name in PARTS + ("sample_tokens",):
        _timed(cls, name, add(name))
    _timed(cls, "execute_model", add("execute_model"), before=scheduled)
    _timed(EngineCore, "step", finish, before=lambda args: cur.clear())
    return steps


def _print_by_rows(steps: list[dict]) -> dict:
    """Median milliseconds of each part per scheduled-rows count, over
    the steps that only decoded."""
    names = ("step", "execute_model", "sample_tokens") + PARTS
    groups: dict[int, list[dict]] = {}
    for st in steps:
        if st["decode"]:
            groups.setdefault(int(st["rows"]), []).append(st)
    out = {}
    short = {"_update_states": "update", "_prepare_inputs": "prepare",
             "_model_forward": "forward", "_sample": "sample",
             "propose_draft_token_ids": "propose", "_bookkeeping_sync": "bookkeep",
             "execute_model": "execute", "sample_tokens": "sample_tok"}
    print("rows  steps " + " ".join(f"{short.get(n, n):>10s}" for n in names))
    for rows in sorted(groups):
        g = groups[rows]
        med = {n: round(statistics.median(st.get(n, 0.0) for st in g) * 1e3, 3)
               for n in names}
        out[rows] = {"steps": len(g), **med}
        print(f"{rows:4d} {len(g):6d} " + " ".join(f"{med[n]:10.2f}" for n in names))
    return out


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
    ap.add_argument("--by-rows", action="store_true",
                    help="also split every step into the runner's parts (forward, "
                         "input preparation, sampling, drafting, ...) and print their "
                         "medians per number of scheduled rows (decode steps only)")
    ap.add_argument("--out", default=None,
                    help="write the JSON here instead of printing it")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the measured runs (0: greedy)")
    ap.add_argument("--sync", action="store_true",
                    help="plain decoding without async scheduling (as speculation runs)")
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
    _timed(GPUModelRunner, "_model_forward", fwd.append)
    _timed(EngineCore, "step", step.append)
    parts = _install_part_timers(spec) if args.by_rows else None
    extra = {"async_scheduling": False} if args.sync else {}
    llm = LLM(model=model, dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=args.batch, seed=0, speculative_config=spec, **extra)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0 if args.temperature > 0 else None)
    warm = suites[0].prompts[: args.batch]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm],
                 SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    rows = []
    parts_all: list[dict] = []
    for s in suites:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in s.prompts]
        for r in range(args.repeats):
            llm.reset_prefix_cache()
            fwd.clear()
            step.clear()
            if parts is not None:
                parts.clear()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            f, st = fwd[args.skip_steps:] or fwd, step[args.skip_steps:] or step
            mf, ms = statistics.median(f) * 1e3, statistics.median(st) * 1e3
            # the whole run's forward and the rest, prefill included: a
            # method's own cost over a suite is its rest against plain
            # decoding's (the forward moves with the engine, see above)
            tf = sum(fwd)
            rows.append({"suite": s.name, "repeat": r, "wall_s": round(wall, 3),
                         "steps": len(step), "forward_ms": round(mf, 2),
                         "rest_ms": round(ms - mf, 2), "forward_total_s": round(tf, 3),
                         "rest_total_s": round(wall - tf, 3)})
            if parts is not None:
                parts_all.extend(parts[args.skip_steps:])
            print(f"{args.spec[:40]:40s} {s.name:24s} r{r} wall {wall:6.2f} s  "
                  f"step {ms:6.1f} ms = forward {mf:6.1f} + rest {ms - mf:5.1f}; "
                  f"run: forward {tf:6.2f} s + rest {wall - tf:5.2f} s", flush=True)
    by_rows = _print_by_rows(parts_all) if args.by_rows else None
    result = {"spec": spec, "batch": args.batch, "machine": machine_info(),
              "runs": rows, "by_rows": by_rows}
    if args.out:
        result_file.write(result, args.out)
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
