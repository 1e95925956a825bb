"""Modeled GPU speedup of head-drafting methods from a ``benchmarks.run`` file.

No GPU is available here, so this turns what a CPU run measured (tau, the
head's batched passes per step) into what a GPU step would cost, under a
stated model rather than a measurement:

* decoding is memory-bound: a forward pass costs the bytes of the weights
  it reads (the embedding is a gather and is not counted; the LM head is);
* verifying a tree costs one target pass whatever its rows, which holds on
  a GPU for trees of up to ~64 rows of a model this small (see the cost-aware
  budget in docs/design.md);
* a step of an EAGLE-3 method adds one head pass over the verified rows
  (``fc`` + decoder layer + LM head over the draft vocabulary: the
  "extend" pass, which also yields the root's children) and one pass per
  further drafted depth (decoder layer + LM head, no ``fc``).

So a step costs ``1 + r_extend + passes * r_draft`` target passes and the
modeled speedup over plain decoding is ``tau / that``. For vLLM's ``eagle3``
chain of ``k`` tokens ``passes = k - 1``; for the plugin's tree methods it is
the measured ``draft_head_passes`` per engine step. Methods without a head
(``recycle``, ``pld``, ...) cost one pass (their proposer is CPU-side work
off the GPU's critical path in this model).

``python -m benchmarks.studies.gpu_model RESULTS.json`` prints the table.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

HEAD_METHODS = ("eagle3", "eagle3_tree", "graft", "reader", "respec")


@dataclass(frozen=True)
class PassCosts:
    r_extend: float
    """A head pass over verified rows, in target passes (fc + layer + LM head)."""
    r_draft: float
    """A head pass over drafted rows, in target passes (layer + LM head)."""


def target_params(cfg: dict) -> int:
    """Weights a Llama-family decode pass reads: every layer plus the LM head."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg["num_key_value_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return cfg["num_hidden_layers"] * layer + cfg["vocab_size"] * h


def pass_costs(head_dir: str | os.PathLike, target_cfg: dict) -> PassCosts:
    """Per-pass cost of a head relative to its target, from the head's own
    tensors (``d2t``/``t2d`` maps and norms are negligible and skipped)."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    with safe_open(str(Path(head_dir) / "model.safetensors"), "pt") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            if len(shape) == 2:
                sizes[k] = math.prod(shape)
    fc = sum(v for k, v in sizes.items() if k.startswith("fc."))
    body = sum(v for k, v in sizes.items() if not k.startswith(("fc.", "embed_tokens.")))
    t = target_params(target_cfg)
    return PassCosts(r_extend=(fc + body) / t, r_draft=body / t)


def head_passes_per_step(rec: dict, k_default: int) -> float | None:
    """Further head passes per engine step (beyond the extend pass); None for
    methods without a head."""
    method = rec["method"].split("@")[0]  # a variant label: "eagle3_tree@n16"
    if method == "eagle3":
        k = (rec.get("method_options") or {}).get("num_speculative_tokens", k_default)
        return float(k - 1)
    if method not in HEAD_METHODS:
        return None
    st = rec.get("specplug_stats") or {}
    steps = st.get("steps") or 0
    passes = (st.get("method") or {}).get("draft_head_passes")
    if not steps or passes is None:
        return None
    return passes / steps


def modeled_speedup(tau: float, passes: float | None, costs: PassCosts) -> float:
    if passes is None:
        return tau
    return tau / (1.0 + costs.r_extend + passes * costs.r_draft)


def rows(doc: dict, costs: PassCosts) -> list[dict]:
    from benchmarks.report import record_tau

    out = []
    k = doc["run"].get("num_speculative_tokens") or 0
    for r in doc["records"]:
        if r.get("status") != "ok" or r["method"] == "none":
            continue
        t = record_tau(r)
        passes = head_passes_per_step(r, k)
        meth = (r.get("specplug_stats") or {}).get("method") or {}
        rows_ = meth.get("draft_head_rows")
        steps = (r.get("specplug_stats") or {}).get("steps") or 0
        out.append({
            "method": r["method"], "suite": r["suite"], "batch_size": r["batch_size"],
            "tau": t, "head_passes_per_step": passes,
            "head_rows_per_step": rows_ / steps if rows_ is not None and steps else None,
            "proposer_time_share": r.get("proposer_time_share"),
            "proposer_ms_per_step": (1000 * r["proposer_seconds"] / steps
                                     if r.get("proposer_seconds") is not None and steps else None),
            "modeled_gpu_speedup": None if t is None else modeled_speedup(t, passes, costs),
        })
    return out


def markdown(doc: dict, costs: PassCosts) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"Modeled GPU step: 1 + {costs.r_extend:.3f} (extend pass) + "
             f"passes x {costs.r_draft:.3f} target passes (memory-bound, flat verification)\n",
             "| method | suite | batch | tau | head passes / step | head rows / step "
             "| proposer ms / step (CPU) | proposer share (CPU) | modeled GPU speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows(doc, costs):
        lines.append(
            f"| {r['method']} | {r['suite'].split(':')[-1]} | {r['batch_size']} "
            f"| {f(r['tau'], '.2f')} | {f(r['head_passes_per_step'], '.1f')} "
            f"| {f(r['head_rows_per_step'], '.1f')} | {f(r['proposer_ms_per_step'], '.1f')} "
            f"| {f(r['proposer_time_share'] and 100 * r['proposer_time_share'], '.0f')}% "
            f"| {f(r['modeled_gpu_speedup'], '.2f')}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.studies.gpu_model RESULTS.json [--head DIR] [--target DIR]``."""
    import argparse

    from vllm_specplug.eagle3 import shipped_head_path
    from vllm_specplug.models.reference import reference_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--head", help="head folder (default: the shipped reference head)")
    ap.add_argument("--target", help="target folder (default: the reference model)")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.results).read_text(encoding="utf-8"))
    target = args.target or reference_model_path()
    head = args.head or shipped_head_path()
    cfg = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    print(markdown(doc, pass_costs(head, cfg)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
