"""Fitting graft's checkpoint thresholds (``specplug graft calibrate``).

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

import itertools
import json
import os
import tempfile
import time

import numpy as np


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


# ------------------------------------------------------------------ a run
def calibrate(model: str, prompts: list[list[int]], *, options: dict,
              num_speculative_tokens: int = 60, max_tokens: int = 128,
              verify_cost: str | None = None, grid: int = 20) -> dict:
    """Record, cost and fit (the module doc) on ``prompts`` (chat-formatted
    token ids); returns what ``graft``'s ``calibration`` option loads."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specplug.config import TOOL_KV_CACHE_BYTES
    from vllm_specplug.eagle3 import default_head_for
    from vllm_specplug.methods.graft import GraftConfig

    cfg = GraftConfig(**options)  # validates the options first, in one line
    head = cfg.head or default_head_for(model)
    if head is None:
        raise ValueError("no shipped head for this target; name one in the options "
                         "('{\"head\": DIR}')")
    n = num_speculative_tokens
    record = os.path.join(tempfile.mkdtemp(prefix="specplug-graft-"), "record.jsonl")
    llm = LLM(model=model, dtype="float32", seed=0, enable_prefix_caching=False,
              kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES,
              speculative_config={"method": "graft", "num_speculative_tokens": n,
                                  **options, "record": record})
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    del llm
    conf, acc = read_records(record)
    head_ms = measure_head_ms(head, [*cfg.checkpoints, cfg.depth - 1], n, cfg.depth, cfg.topk)
    step_ms = np.array(head_ms) + verify_ms(verify_cost, n)
    thresholds, best = fit_thresholds(conf, acc, step_ms, grid)
    unpruned = [0.0] * len(thresholds)
    paper = [0.14, 0.14, 0.49][:len(thresholds)]  # the paper's Table 11
    return {
        "checkpoints": list(cfg.checkpoints), "thresholds": thresholds,
        "tokens_per_ms": best,
        "tokens_per_ms_unpruned": objective(conf, acc, step_ms, unpruned),
        "tokens_per_ms_table11": objective(conf, acc, step_ms, paper),
        "mean_accepted_per_stage": acc.mean(axis=0).tolist(),
        "step_ms_per_stage": step_ms.tolist(), "head_ms_per_stage": head_ms,
        "verify_cost": verify_cost, "steps": int(conf.shape[0]),
        "model": os.path.basename(os.path.normpath(model)), "head": head,
        "num_prompts": len(prompts), "num_speculative_tokens": n,
    }
