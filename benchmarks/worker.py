"""One benchmark configuration (method x batch size) in a fresh process.

    python -m benchmarks.worker JOB.json

``benchmarks.run`` starts one of these per method x batch size: vLLM 0.32's
built-in ``ngram`` cannot start after another engine in the same process (CPU
build), and a fresh process gives a clean peak-memory figure
(``ru_maxrss``). The job file says what to run (model, dtype, speculative
config, ``max_num_seqs``, prompts per suite); the result file gets the
outputs, wall times and counter deltas per suite. Progress lines (JSON) go to
the file descriptor ``progress_fd`` of the job, so that vLLM's own logging
(captured in a log file by the parent) stays out of the way.

Result ``status``:

* ``ok``;
* ``skipped``: the engine could not be built for a reason that means "cannot
  run here" (a vLLM method whose requirements are missing, a specplug
  option error, a missing import);
* ``error``: anything else (the traceback's last line is the reason).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _progress(fd: int | None, **event) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())
    except OSError:
        pass


def _go(job: dict) -> None:
    """Paired runs (``benchmarks.run --paired``): wait for the harness's turn
    signal before a timed ``generate``, so that two engines are timed one
    after the other, never at once."""
    fd = job.get("go_fd")
    if fd is None:
        return
    if not os.read(fd, 1):
        raise RuntimeError("paired run: the harness stopped the pairing")


def chunk_starts(n: int, chunk: int | None) -> range:
    """Where each timed call of a suite of ``n`` prompts starts, ``chunk``
    prompts a call (None or 0: the whole suite). One call even for an empty
    suite: ``benchmarks.run`` counts the turns it gives a pair with this."""
    return range(0, max(1, n), max(1, chunk or n))


def _timed_generate(llm, prompts: list, params, job: dict, suite: str):
    """One timed ``generate`` of a suite's prompts: ``(outputs, wall seconds,
    [[start, end] wall-clock span of each timed call]``.

    In a paired run (``pair_chunk`` set) the prompts go in chunks of that
    many, each chunk its own timed call in turn with the other engine's same
    chunk: a shared machine's speed moves by up to 12 % between two
    adjacent 45-second suite calls (a never-drafting method beside plain
    decoding read 0.89x, 0.97x, 1.01x in three such repeats), and
    several-second calls meet the machine in more nearly the same state.
    At batch 1 (chunks of one prompt) the scheduling is the whole call's;
    at a larger batch a chunk of the batch size drains before the next one
    starts (no refill across chunks), alike for both engines. The suite's
    wall time is the chunks' sum."""
    calls = chunk_starts(len(prompts), job.get("pair_chunk"))
    outs, wall, spans = [], 0.0, []
    for i in calls:
        _go(job)
        t0 = time.time()
        t = time.perf_counter()
        outs += llm.generate(prompts[i:i + calls.step], params, use_tqdm=False)
        dt = time.perf_counter() - t
        wall += dt
        spans.append([t0, time.time()])
        _progress(job.get("progress_fd"), event="timed", suite=suite, wall_seconds=dt)
    return outs, wall, spans


def _counters(llm) -> dict:
    """vLLM's spec-decode counters, summed over label sets."""
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                 "accepted_tokens_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_tokens_per_pos",
    }
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is None:
            continue
        if key == "accepted_tokens_per_pos":
            vals = list(getattr(m, "values", []) or [])
            acc = out[key]
            acc.extend([0] * (len(vals) - len(acc)))
            for i, v in enumerate(vals):
                acc[i] += v
        else:
            out[key] += getattr(m, "value", 0) or 0
    return out


def _counter_delta(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    b = before["accepted_tokens_per_pos"]
    out["accepted_tokens_per_pos"] = [
        v - (b[i] if i < len(b) else 0) for i, v in enumerate(after["accepted_tokens_per_pos"])
    ]
    return out


def _specplug_stats(llm) -> dict | None:
    import copy

    try:
        # In-process engine: the RPC hands back the live dicts; copy them.
        return copy.deepcopy(llm.collective_rpc("specplug_stats")[0])
    except Exception:  # not a specplug engine: its worker has no such method
        return None


def _method_delta(before: dict, after: dict, counters: list[str],
                  method: str | None) -> dict:
    """A proposer's own stats over one suite: the counters it declares
    (``ProposerStats.counters``) as differences, its rates recomputed from
    those differences (``Proposer.rates``), everything else (gauges,
    latency summaries) as of the end of the suite. Subtracting two rates
    would be meaningless."""
    out = {k: after[k] - before.get(k, 0) if k in counters
           else _latency_delta(before.get(k), after[k]) for k in after}
    from vllm_specplug import registry

    if registry.is_registered(method):
        out.update(registry.get(method).rates({k: out[k] for k in counters if k in out}))
    return out


def _latency_delta(before, after):
    """A latency summary (``RunningStat.as_ms``: ``n``, ``mean_ms``,
    ``total_s``, ...) over the suite alone: its count, total and mean from
    the differences, and the engine's slowest call so far as
    ``engine_max_ms`` (the warm-up's first calls, which the engine pays once,
    are in it; a maximum cannot be differenced). Anything else as ``after``."""
    if not (isinstance(after, dict) and "n" in after and (after["n"] == 0 or "total_s" in after)):
        return after
    prev = before if isinstance(before, dict) else {}
    n = after["n"] - prev.get("n", 0)
    total = after.get("total_s", 0.0) - prev.get("total_s", 0.0)
    out = {"n": n, "total_s": total, "mean_ms": 1e3 * total / n if n else None}
    if "max_ms" in after:
        out["engine_max_ms"] = after["max_ms"]
    return out


def _budget_delta(before: dict, after: dict) -> dict:
    """The cost-aware budget's stats over one suite: its counters
    (``BudgetStats``) as differences, its estimates (step-cost curve,
    acceptance, calibration) as of the end of the suite."""
    import dataclasses

    from vllm_specplug.engine.budget import BudgetStats

    counters = {f.name for f in dataclasses.fields(BudgetStats)}
    out = {}
    for k, v in after.items():
        if k not in counters:
            out[k] = v
        elif isinstance(v, dict):
            prev = before.get(k, {})
            out[k] = {n: c - prev.get(n, 0) for n, c in v.items() if c - prev.get(n, 0)}
        else:
            out[k] = v - before.get(k, 0)
    return out


_LEVELS = {"live_trees", "cpu_linear_layers", "cpu_linear_shapes"}
"""Numbers in ``specplug_stats()`` that are levels: kept as of the suite's end."""


def _stats_delta(before: dict | None, after: dict | None,
                 method: str | None = None) -> dict | None:
    if before is None or after is None:
        return None
    out: dict = {}
    for key, value in after.items():
        prev = before.get(key)
        if isinstance(value, bool) or key.startswith("mean_"):
            continue
        if key in _LEVELS:  # how things stand, not running totals
            out[key] = value
            continue
        if key == "method" and isinstance(value, dict) and isinstance(prev, dict):
            out[key] = _method_delta(prev, value, after.get("method_counters", []), method)
        elif key == "budget" and isinstance(value, dict) and isinstance(prev, dict):
            out[key] = _budget_delta(prev, value)
        elif isinstance(value, (int, float)) and isinstance(prev, (int, float)):
            out[key] = value - prev
        elif isinstance(value, dict) and isinstance(prev, dict) and all(
                isinstance(v, (int, float)) for v in value.values()):
            d = {str(k): v - prev.get(k, 0) for k, v in value.items()}
            out[key] = {k: v for k, v in sorted(d.items(), key=lambda kv: _num(kv[0])) if v}
        else:
            out[key] = value  # e.g. the proposer's own stats: as of the end
    drafts = out.get("drafts") or 0
    if "accepted_tokens" in out:
        out["mean_accepted_length"] = 1 + out["accepted_tokens"] / drafts if drafts else 1.0
    if "draft_tokens" in out:
        out["mean_tree_size"] = out["draft_tokens"] / drafts if drafts else 0.0
    return out


def _num(s: str):
    try:
        return (0, int(s))
    except ValueError:
        return (1, s)


def cpu_linear_state(kind: str, stats: dict | None) -> dict | None:
    """Whether this engine runs the plugin's CPU linear kernel and on which
    layers: only specplug engines route layers to it (``runner/cpu_gemm``),
    unless ``SPECPLUG_CPU_LINEAR=0``; None for stock vLLM engines."""
    if kind != "specplug":
        return None
    stats = stats or {}
    return {"env": os.environ.get("SPECPLUG_CPU_LINEAR"),
            "layers": stats.get("cpu_linear_layers"),
            "shapes": stats.get("cpu_linear_shapes")}


def _cannot_run_here(job: dict, exc: BaseException) -> bool:
    """Does an engine start-up failure mean "this method cannot run here"?"""
    if job["kind"] == "baseline":
        return False
    if isinstance(exc, ImportError):
        return True
    if job["kind"] == "vllm":
        return True  # vLLM refused its own method (missing package, head, ...)
    from vllm_specplug.config import SpecplugConfigError

    return isinstance(exc, SpecplugConfigError)


def _reason(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}"
    # pydantic wraps vLLM's own message after a header line: keep it.
    for line in msg[1:4]:
        if line.strip() and "validation error" not in line:
            text += " | " + line.strip()
    return text[:500]


def _compile_source(job: dict) -> str:
    """How the engine got its model: ``eager``, ``loaded`` (vLLM's compile
    cache) or ``compiled`` (this start compiled it; the next one loads it).
    vLLM's counters are per process, and the worker starts one engine."""
    if job.get("enforce_eager", False):
        return "eager"
    from vllm.compilation.counter import compilation_counter

    return "loaded" if compilation_counter.num_aot_artifacts_loaded else "compiled"


def run(job: dict) -> dict:
    import resource

    fd = job.get("progress_fd")
    result: dict = {"status": "ok", "reason": None, "suites": []}
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams, TokensPrompt

        result["vllm_version"] = vllm.__version__
        result["enforce_eager"] = job.get("enforce_eager", False)
        llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
                  max_num_seqs=job["batch_size"],
                  enforce_eager=job.get("enforce_eager", False), seed=job["seed"],
                  disable_log_stats=False, speculative_config=job["spec"],
                  **job.get("engine_options", {}),
                  **({"kv_cache_memory_bytes": job["kv_cache_bytes"]}
                     if job.get("kv_cache_bytes") else {}))
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        result["status"] = "skipped" if _cannot_run_here(job, exc) else "error"
        result["reason"] = _reason(exc)
        result["traceback"] = traceback.format_exc()[-4000:]
        return result
    result["init_seconds"] = time.perf_counter() - t0
    result["engine_compile"] = _compile_source(job)
    _progress(fd, event="ready", init_seconds=result["init_seconds"],
              engine_compile=result["engine_compile"])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                                ignore_eos=job["ignore_eos"], seed=job["seed"])
        # Warm-up (not timed, not counted): prompts of the suites' typical
        # lengths made of neutral filler text, so first-use costs of prefill
        # and decode shapes do not land on the first suite. Paired runs warm
        # their engines up one at a time (the harness's turn signal): what a
        # method measures of its own costs here (a head's time per request)
        # outlives the warm-up, and engines warming up at once would each
        # measure a share of the cores.
        _go(job)
        warm_from = time.time()
        for ids in job["warmup_prompts"]:
            warm = [TokensPrompt(prompt_token_ids=ids)] * min(2, job["batch_size"])
            llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=16,
                                              ignore_eos=True), use_tqdm=False)
        result["warmup_span"] = [warm_from, time.time()]
        if job["kind"] == "specplug":
            # the warm-up is for shapes, not for learning: repetitive filler
            # is drafted almost perfectly and would open the budget's gate
            # for the first suite, and its step times are those of a cold
            # engine (engine/budget.BudgetController.reset_learning); the
            # first suite meets what a user's first requests meet
            llm.collective_rpc("specplug_reset_budget")
        result["cpu_linear"] = cpu_linear_state(job["kind"], _specplug_stats(llm))
        _progress(fd, event="warmed")
        for suite in job["suites"]:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in suite["prompts"]]
            c0, s0 = _counters(llm), _specplug_stats(llm)
            outs, wall, spans = _timed_generate(llm, prompts, params, job, suite["name"])
            c1, s1 = _counters(llm), _specplug_stats(llm)
            outputs = [list(o.outputs[0].token_ids) for o in outs]
            walls = [wall]
            for _ in range(job.get("repeats", 1) - 1):
                # timing only: the counters and outputs are the first run's.
                # vLLM's prefix cache would serve the repeated prompts'
                # prefill (2x on summarization): start it empty, as the
                # first run found it.
                llm.reset_prefix_cache()
                again, w, more = _timed_generate(llm, prompts, params, job, suite["name"])
                walls.append(w)
                spans += more
                if [list(o.outputs[0].token_ids) for o in again] != outputs:
                    raise RuntimeError(f"{suite['name']}: a repeated greedy generate gave "
                                       "other tokens than the first")
            wall = sorted(walls)[len(walls) // 2]
            entry = {
                "name": suite["name"],
                "outputs": outputs,
                "wall_seconds": wall,
                "wall_seconds_repeats": walls if len(walls) > 1 else None,
                "timed_spans": spans,  # wall-clock [start, end] of each timed call
                "generated_tokens": sum(map(len, outputs)),
                "counters": _counter_delta(c0, c1),
                "specplug_stats": _stats_delta(s0, s1, (job.get("spec") or {}).get("method")),
            }
            result["suites"].append(entry)
            _progress(fd, event="suite", suite=suite["name"], wall_seconds=wall,
                      generated_tokens=entry["generated_tokens"],
                      num_prompts=len(outputs), counters=entry["counters"])
    except Exception as exc:  # noqa: BLE001
        result["status"] = "error"
        result["reason"] = _reason(exc)
        result["traceback"] = traceback.format_exc()[-4000:]
    result["peak_memory_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    result = run(job)
    tmp = job["result_path"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, job["result_path"])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (vLLM's atexit hooks can hang or crash after
    # the result is safely written).
    os._exit(0)


if __name__ == "__main__":
    main()
