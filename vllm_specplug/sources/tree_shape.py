"""Tree-shape optimisation (READER, Appendix E and Theorem 1).

A static draft tree's throughput is

    (1 + sum_i alpha_i) / (T_V(|T|) + sum_i t_i)

with ``alpha_i`` node ``i``'s acceptance frequency (the share of steps in
which it is accepted), ``T_V`` the measured verification step time for a
tree of that size and ``t_i`` a per-node drafting time. Starting from an
over-sized seed template whose per-node acceptance was measured on
calibration prompts, the lowest-acceptance leaf is pruned again and again
(a child is never accepted more often than its parent, so this keeps a
valid prefix-closed tree); every size is then scored by the formula, which
is the 1-D search over the pruning level (exhaustive: the profile makes each
point free to evaluate, so no golden-section search is needed).

The cost curve is an input (``benchmarks/verify_cost.py``'s JSON), so the
shape chosen on one machine is not silently another's default.

Template files (``*.json``) hold rank paths, best first (every prefix is a
valid template), and load wherever a template spec is accepted
(``eagle3_tree``/``reader`` static mode, ``recycle``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specplug.sources.template import TreeTemplate

FORMAT = "specplug-tree-template"


@dataclass
class ShapeChoice:
    template: TreeTemplate
    """The chosen tree, best node first."""
    size: int
    expected_tokens: float
    """1 + sum of the kept nodes' acceptance: tokens per step."""
    step_ms: float
    curve: list[dict]
    """Every size tried: size, expected tokens, step ms, tokens per ms."""


class CostCurve:
    """Step time (ms) vs tree size, linear between measured sizes and
    extrapolated from the last two beyond the largest."""

    def __init__(self, sizes: Sequence[int], step_ms: Sequence[float]) -> None:
        order = np.argsort(sizes)
        self.sizes = np.asarray(sizes, dtype=float)[order]
        self.ms = np.asarray(step_ms, dtype=float)[order]
        if self.sizes.size < 2:
            raise ValueError("a cost curve needs at least two tree sizes")

    @classmethod
    def from_verify_cost(cls, path: str, batch_size: int) -> CostCurve:
        """From ``python -m benchmarks.verify_cost --out`` JSON."""
        with open(path, encoding="utf-8") as f:
            recs = [r for r in json.load(f)["records"] if r.get("batch_size") == batch_size]
        if len(recs) < 2:
            raise ValueError(f"{path}: fewer than two tree sizes at batch size {batch_size}")
        return cls([r["tree_size"] for r in recs], [r["step_ms"] for r in recs])

    def __call__(self, size: float) -> float:
        s, m = self.sizes, self.ms
        if size <= s[-1]:
            return float(np.interp(size, s, m))
        slope = (m[-1] - m[-2]) / (s[-1] - s[-2])
        return float(m[-1] + slope * (size - s[-1]))


def prune_order(template: TreeTemplate, alpha: Sequence[float]) -> list[int]:
    """Template nodes in the order Appendix E removes them: the leaf with
    the lowest acceptance first (ties: the deeper, then the later node)."""
    alive = set(range(len(template)))
    kids = [0] * len(template)
    for p in template.parents:
        if p >= 0:
            kids[p] += 1
    order = []
    while alive:
        leaf = min((i for i in alive if kids[i] == 0),
                   key=lambda i: (alpha[i], -template.depths[i], -i))
        order.append(leaf)
        alive.remove(leaf)
        if template.parents[leaf] >= 0:
            kids[template.parents[leaf]] -= 1
    return order


def choose_shape(template: TreeTemplate, alpha: Sequence[float], cost: CostCurve, *,
                 draft_ms_per_node: float = 0.0, extra_nodes: int = 0,
                 min_size: int = 1, max_size: int | None = None) -> ShapeChoice:
    """Theorem 1 over the pruning sequence of ``template``: the size (within
    ``[min_size, max_size]``) with the most expected tokens per ms.

    ``extra_nodes``: rows verified beside the template every step (e.g.
    ``reader``'s search paths), costed but not credited."""
    alpha = np.asarray(alpha, dtype=float)
    removed = prune_order(template, alpha)
    n = len(template)
    max_size = n if max_size is None else min(max_size, n)
    kept = set(range(n))
    curve, best = [], None
    for size in range(n, min_size - 1, -1):
        if size <= max_size:
            exp = 1.0 + float(alpha[list(kept)].sum())
            ms = cost(size + extra_nodes) + draft_ms_per_node * size
            point = {"size": size, "expected_tokens": exp, "step_ms": ms,
                     "tokens_per_ms": exp / ms}
            curve.append(point)
            if best is None or point["tokens_per_ms"] > best[0]["tokens_per_ms"] + 1e-12:
                best = (point, set(kept))
        if size > min_size:
            kept.remove(removed[n - size])
    point, nodes = best
    return ShapeChoice(_subtemplate(template, alpha, nodes), point["size"],
                       point["expected_tokens"], point["step_ms"], curve[::-1])


def _subtemplate(template: TreeTemplate, alpha: np.ndarray, nodes: set[int]) -> TreeTemplate:
    """The kept nodes as a template, best first (acceptance, then depth), so
    every prefix is itself a tree."""
    paths = template.rank_paths()
    order = sorted(nodes, key=lambda i: (-alpha[i], template.depths[i], i))
    return TreeTemplate.from_rank_paths([paths[i] for i in order])


def node_acceptance(template: TreeTemplate, steps: int,
                    accepted_paths: Sequence[Sequence[int]]) -> np.ndarray:
    """``alpha`` per template node from ``steps`` verified trees and, per
    step, the rank path the target accepted (its prefixes are accepted)."""
    index = {p: i for i, p in enumerate(template.rank_paths())}
    hits = np.zeros(len(template))
    for path in accepted_paths:
        for d in range(1, len(path) + 1):
            i = index.get(tuple(path[:d]))
            if i is None:
                break
            hits[i] += 1
    return hits / max(1, steps)


def save_template(path: str, template: TreeTemplate, meta: dict | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "rank_paths": [list(p) for p in template.rank_paths()],
                   "level_sizes": template.level_sizes(), "meta": meta or {}}, f, indent=1)
