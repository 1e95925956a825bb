"""`specplug graft calibrate`: fit graft's checkpoint thresholds.

    specplug graft calibrate --prompts FILE --out graft_cal.json \\
        [--model DIR] [--limit 32] [--max-tokens 128] [--num-speculative-tokens 60] \\
        [--verify-cost benchmarks/results/verify_cost.json]

The paper only sketches calibration ("in the spirit of ECHO"). Here:

1. **Record.** The target decodes the prompts greedily with ``graft`` in
   recording mode (its ``record`` option): the head is never stopped, and
   every drafted step logs the confidence at each checkpoint and how many
   tokens each stage's tree (pruned at d0, d1, d5, or not at all) would have
   had accepted. Greedy output does not depend on the verified tree, so
   these counterfactuals are exact.
2. **Cost.** A step costs the target's verification of the fixed budget
   (read from a ``benchmarks.verify_cost`` JSON, batch 1, interpolated; a
   flat curve without one, which is what a GPU looks like) plus the head's
   drafting up to the stage's checkpoint, measured here on this device
   (``measure_head_ms``).
3. **Fit.** Thresholds are chosen on a grid of the recorded confidences'
   quantiles to maximise accepted tokens per millisecond,
   ``sum(1 + accepted) / sum(step ms)`` (``fit_thresholds``).

The output JSON is what ``graft``'s ``calibration`` option loads. The
calibration prompts must not be evaluation prompts (not Spec-Bench
``mt_bench``/``math_reasoning``, not ``humaneval:odd``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time

import numpy as np


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "graft", help="graft method tools (threshold calibration)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="graft_command", metavar="ACTION")
    cal = sub.add_parser("calibrate", help="fit the pruning thresholds on calibration prompts")
    cal.add_argument("--prompts", required=True,
                     help="corpus file of prompts (.jsonl with 'prompt'/'turns'/'text', or "
                          ".txt); in a repository checkout also a benchmark suite name "
                          "such as humaneval:even")
    cal.add_argument("--out", required=True, help="calibration JSON to write")
    cal.add_argument("--model", default=None, help="target folder (default: reference model)")
    cal.add_argument("--limit", type=int, default=32, help="prompts used (default 32)")
    cal.add_argument("--max-tokens", type=int, default=128)
    cal.add_argument("--num-speculative-tokens", type=int, default=60)
    cal.add_argument("--options", default="{}",
                     help="more graft options (JSON), e.g. head, depth, topk, table_path")
    cal.add_argument("--verify-cost", default=None,
                     help="benchmarks.verify_cost JSON of this target on the serving "
                          "device (default: flat verification cost)")
    cal.add_argument("--grid", type=int, default=20, help="quantiles tried per checkpoint")
    cal.set_defaults(func=_calibrate)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


# ------------------------------------------------------------------ fitting
def fit_thresholds(conf: np.ndarray, accepted: np.ndarray, step_ms: np.ndarray,
                   grid: int = 20) -> tuple[list[float], float]:
    """Thresholds maximising ``sum(1 + accepted) / sum(step_ms)``.

    ``conf[s, i]``: confidence at checkpoint ``i`` of step ``s`` (NaN: the
    head never got there, so no pruning there); ``accepted[s, i]``: tokens
    accepted had the tree been pruned at checkpoint ``i`` (last column: not
    pruned); ``step_ms[i]``: cost of a step ending at stage ``i`` (same
    columns). A step is pruned at the first ``i`` with ``conf <= tau_i``.
    """
    steps, n = conf.shape
    if accepted.shape != (steps, n + 1) or step_ms.shape != (n + 1,):
        raise ValueError("accepted must be [steps, checkpoints + 1], step_ms [checkpoints + 1]")
    cands = []
    for i in range(n):
        c = conf[:, i][~np.isnan(conf[:, i])]
        qs = np.quantile(c, np.linspace(0, 1, grid + 1)) if len(c) else np.array([])
        cands.append(np.unique(np.concatenate([[0.0, 1.0], qs])))
    best, best_t = -1.0, None
    for combo in itertools.product(*cands):
        value = objective(conf, accepted, step_ms, [float(t) for t in combo])
        if value > best + 1e-12:
            best, best_t = value, [float(t) for t in combo]
    # The grid only holds quantiles; refine one threshold at a time over
    # every recorded confidence (the objective only changes there).
    for _ in range(3):
        moved = False
        for i in range(n):
            c = np.unique(conf[:, i][~np.isnan(conf[:, i])])
            if len(c) > 4000:
                c = np.quantile(c, np.linspace(0, 1, 4001))
            for t in np.concatenate([[0.0, 1.0], c]):
                trial = best_t[:i] + [float(t)] + best_t[i + 1:]
                value = objective(conf, accepted, step_ms, trial)
                if value > best + 1e-12:
                    best, best_t, moved = value, trial, True
        if not moved:
            break
    return best_t, best


def objective(conf, accepted, step_ms, thresholds) -> float:
    """``sum(1 + accepted) / sum(step_ms)`` under given thresholds."""
    steps, n = conf.shape
    left = np.ones(steps, dtype=bool)
    tokens = ms = 0.0
    for i, t in enumerate(thresholds):
        hit = left & (np.nan_to_num(conf[:, i], nan=np.inf) <= t)
        tokens += (1.0 + accepted[hit, i]).sum()
        ms += step_ms[i] * hit.sum()
        left &= ~hit
    tokens += (1.0 + accepted[left, n]).sum()
    ms += step_ms[n] * left.sum()
    return tokens / ms if ms > 0 else 0.0


def read_records(path: str) -> tuple[np.ndarray, np.ndarray]:
    conf, acc = [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            conf.append([np.nan if c is None else c for c in rec["conf"]])
            acc.append(rec["accepted"])
    if not conf:
        raise ValueError(f"{path}: no recorded steps (did any request draft?)")
    return np.array(conf, dtype=np.float64), np.array(acc, dtype=np.float64)


def verify_ms(path: str | None, nodes: int) -> float:
    """Batch-1 step time for a tree of ``nodes`` nodes, interpolated from a
    ``benchmarks.verify_cost`` JSON (None: 1.0, a flat curve)."""
    if path is None:
        return 1.0
    with open(path) as f:
        recs = [r for r in json.load(f)["records"] if r.get("batch_size") == 1]
    if not recs:
        raise ValueError(f"{path}: no batch-1 records")
    xs = np.array([r["tree_size"] for r in recs], dtype=float)
    ys = np.array([r["step_ms"] for r in recs], dtype=float)
    order = np.argsort(xs)
    return float(np.interp(nodes, xs[order], ys[order]))


def measure_head_ms(head_dir: str, expansions: list[int], budget: int, depth: int,
                    topk: int, context: int = 256, repeats: int = 5) -> list[float]:
    """Milliseconds the head spends drafting one request's tree when it
    stops after each number of ``expansions`` (random features and
    embeddings: the cost does not depend on the values)."""
    import torch

    from vllm_specplug.eagle3.model import load_head
    from vllm_specplug.eagle3.runtime import Eagle3Runtime

    with open(os.path.join(head_dir, "config.json")) as f:
        hc = json.load(f)
    hidden = hc.get("target_hidden_size", hc["hidden_size"])
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(hc["vocab_size"], hidden, generator=g) * 0.02
    rt = Eagle3Runtime(load_head(head_dir, embed))
    rt.add("r")
    toks = np.random.default_rng(0).integers(0, hc["vocab_size"], context + 1)
    aux = torch.randn(context, 3 * hidden, generator=g)
    rt.extend([("r", 0, toks, aux)])
    out = []
    for e in expansions:
        def hook(d, _front, stop_at=e + 1):
            return torch.tensor([d < stop_at])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            rt.draft(["r"], [budget], depth=depth, topk=topk, hook=hook)
            times.append(time.perf_counter() - t0)
        out.append(1000.0 * float(np.median(times)))
    return out


# ------------------------------------------------------------------ the CLI
def _prompts(spec: str, limit: int, tokenizer) -> list[list[int]]:
    from vllm_specplug.corpus import chat_ids, iter_prompts

    if os.path.exists(spec):
        turns = [t[0] for _, t in itertools.islice(iter_prompts(spec), limit)]
        return [chat_ids(tokenizer, t) for t in turns]
    try:
        from benchmarks import suites
    except ImportError:
        raise SystemExit(f"specplug graft calibrate: no such file {spec!r}") from None
    return [chat_ids(tokenizer, text) for text in suites.load(spec).texts[:limit]]


def _calibrate(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specplug.config import TOOL_KV_CACHE_BYTES
    from vllm_specplug.eagle3 import default_head_for
    from vllm_specplug.methods.graft import GraftConfig
    from vllm_specplug.models.reference import reference_model_path

    model = args.model or reference_model_path()
    opts = json.loads(args.options)
    cfg = GraftConfig(**opts)  # validates the options first, in one line
    head = cfg.head or default_head_for(model)
    if head is None:
        raise SystemExit("specplug graft calibrate: no shipped head for this target; "
                         "pass --options '{\"head\": DIR}'")
    n = args.num_speculative_tokens
    record = os.path.join(tempfile.mkdtemp(prefix="specplug-graft-"), "record.jsonl")
    llm = LLM(model=model, dtype="float32", seed=0, enable_prefix_caching=False,
              kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES,
              speculative_config={"method": "graft", "num_speculative_tokens": n,
                                  **opts, "record": record})
    prompts = _prompts(args.prompts, args.limit, llm.get_tokenizer())
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=True)
    del llm
    conf, acc = read_records(record)
    expansions = [*cfg.checkpoints, cfg.depth - 1]
    head_ms = measure_head_ms(head, expansions, n, cfg.depth, cfg.topk)
    step_ms = np.array(head_ms) + verify_ms(args.verify_cost, n)
    thresholds, best = fit_thresholds(conf, acc, step_ms, args.grid)
    out = {
        "checkpoints": list(cfg.checkpoints), "thresholds": thresholds,
        "tokens_per_ms": best,
        "tokens_per_ms_unpruned": objective(conf, acc, step_ms, [0.0] * len(thresholds)),
        "tokens_per_ms_table11": objective(conf, acc, step_ms, [0.14, 0.14, 0.49][:len(
            thresholds)]),
        "mean_accepted_per_stage": acc.mean(axis=0).tolist(),
        "step_ms_per_stage": step_ms.tolist(), "head_ms_per_stage": head_ms,
        "verify_cost": args.verify_cost, "steps": int(conf.shape[0]),
        "model": os.path.basename(os.path.normpath(model)), "head": head,
        "prompts": args.prompts, "num_prompts": len(prompts),
        "num_speculative_tokens": n,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}: thresholds {['%.3f' % t for t in thresholds]} at "
          f"checkpoints {cfg.checkpoints}; {best:.4f} tokens/ms vs "
          f"{out['tokens_per_ms_unpruned']:.4f} unpruned over {out['steps']} steps")
    return 0
