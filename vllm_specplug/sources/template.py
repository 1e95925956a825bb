"""Static draft-tree templates over successor ranks (Token Recycling / Graft).

A template node says "take the ``rank``-th successor of my parent's token";
expanding it from a root token through an :class:`AdjacencyTable` gives a
draft tree. The shape is fixed per engine, so one expansion serves the whole
batch: nodes of one level depend only on the level above, and each level is a
single gather for all requests.

Templates are deliberately unbalanced: top-ranked successors get more
children and deeper chains, low ranks a few leaves for width. Nodes are
stored best-first by a prior path score, which is strictly decreasing from
parent to child, so the order is topological and every prefix (``cut``) is
a valid template, the best-scoring one of its size within this template --
which is how Graft picks a smaller retrieval branch once pruning has decided
how many slots are free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_specplug.engine.tree import DraftTree

if TYPE_CHECKING:
    from vllm_specplug.sources.adjacency import AdjacencyTable

# Assumed chance that the rank-r successor is the right next token. Only used
# to choose and order nodes; the shape matters far more than these values.
# A dominant rank 0 lets the greedy chain outrank wide shallow leaves.
RANK_PRIOR = (
    0.6, 0.14, 0.07, 0.045, 0.03, 0.022, 0.017, 0.013,
    0.011, 0.009, 0.008, 0.007, 0.006, 0.005, 0.0045, 0.004,
)

# Nodes per level (which nodes fill a level is our own rule, see
# from_level_counts). "default" has the level sizes of Graft's full retrieval
# envelope (Table 7: 80 nodes, 9 levels), "tr" those of Token Recycling's
# default tree (80 nodes, 6 levels), graft_d* those of Graft's per-pruning-
# stage templates (52, 36 and 20 nodes).
PRESETS: dict[str, tuple[int, ...]] = {
    "default": (8, 16, 14, 11, 8, 7, 6, 5, 5),
    "tr": (8, 21, 25, 15, 8, 3),
    "graft_d0": (8, 10, 8, 6, 5, 4, 4, 4, 3),
    "graft_d1": (6, 7, 5, 4, 4, 3, 3, 2, 2),
    "graft_d5": (4, 3, 3, 2, 2, 2, 2, 1, 1),
}


# Rank-path templates measured on the reference model (SmolLM2-135M-Instruct)
# by ``python -m benchmarks.studies.rank_acceptance`` (a replay of recycle's table
# over held-out Spec-Bench + HumanEval answers, see its docstring;
# benchmarks/results/rank_acceptance.json): the ``n`` rank paths most often
# followed by the target, with that share of positions. Their sum is the
# template's expected accepted tokens per step on that replay: 0.89 (m8) and
# 1.09 (m16) over 1,717 positions; depth-1 acceptance by rank was 0.33,
# 0.089, 0.043, 0.027, 0.026, 0.009, 0.010, 0.009 -- rank 0 dominates, so
# both are mostly the greedy chain with the next ranks at the root.
MEASURED: dict[str, tuple[tuple[tuple[int, ...], float], ...]] = {
    "m16": (
        ((0,), 0.3296),
        ((0, 0), 0.1712),
        ((0, 0, 0), 0.1019),
        ((1,), 0.0891),
        ((0, 0, 0, 0), 0.0676),
        ((0, 0, 0, 0, 0), 0.0472),
        ((2,), 0.0431),
        ((0, 0, 0, 0, 0, 0), 0.0367),
        ((0, 0, 0, 0, 0, 0, 0), 0.0297),
        ((1, 0), 0.0291),
        ((3,), 0.0268),
        ((0, 1), 0.0268),
        ((4,), 0.0256),
        ((0, 0, 0, 0, 0, 0, 0, 0), 0.0245),
        ((0, 0, 0, 0, 0, 0, 0, 0, 0), 0.0227),
        ((0, 0, 0, 0, 0, 0, 0, 0, 0, 0), 0.0210),
    ),
}
# The 8 most frequent paths are the first 8 of the 16.
MEASURED["m8"] = MEASURED["m16"][:8]


def parse_level_counts(spec: str) -> tuple[int, ...]:
    """A preset name or comma-separated nodes per level, e.g. ``"8,4,2"``;
    for a template file (``*.json``), its level sizes (the measured
    rank-path presets have no level counts: ``()``)."""
    spec = spec.strip()
    if spec in MEASURED:
        return ()
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith(".json"):
        return tuple(load_template_file(spec).level_sizes())
    try:
        counts = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(
            f"'{spec}' is neither a preset ({', '.join([*PRESETS, *MEASURED])}) nor "
            "comma-separated nodes per level like '8,4,2'"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"'{spec}': every level needs at least one node")
    return counts


class TreeTemplate:
    """Parent index + successor rank per node, in topological order."""

    def __init__(self, parents: Sequence[int], ranks: Sequence[int],
                 scores: Sequence[float] | None = None) -> None:
        if len(parents) != len(ranks):
            raise ValueError("parents and ranks differ in length")
        self.parents = tuple(int(p) for p in parents)
        self.ranks = tuple(int(r) for r in ranks)
        self.scores = None if scores is None else tuple(float(x) for x in scores)
        """Per node: the chance it is accepted (a rank-prior product, or
        measured); draft trees carry it so they can be merged and cut
        best-first with other scored candidates."""
        if self.scores is not None and len(self.scores) != len(self.parents):
            raise ValueError("scores and parents differ in length")
        depths: list[int] = []
        seen: set[tuple[int, int]] = set()
        for i, (p, r) in enumerate(zip(self.parents, self.ranks)):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: not topological")
            if r < 0 or (p, r) in seen:
                raise ValueError(f"node {i}: rank {r} is negative or repeated")
            seen.add((p, r))
            depths.append(1 if p < 0 else depths[p] + 1)
        self.depths = tuple(depths)
        self._chain = self._find_greedy_chain()
        # Per level: (its nodes, their parent nodes, their ranks).
        par, rk, dep = (np.array(x, dtype=np.int64) for x in (self.parents, self.ranks, depths))
        self._host_levels = [
            (nodes, par[nodes], rk[nodes])
            for nodes in (np.flatnonzero(dep == d) for d in range(1, self.depth + 1))
        ]
        self._device_cache: dict[torch.device, tuple] = {}

    # ------------------------------------------------------------ building
    @classmethod
    def from_rank_paths(cls, paths: Sequence[Sequence[int]],
                        scores: Sequence[float] | None = None) -> TreeTemplate:
        """From rank paths like ``[0], [1], [0, 0]``; each path's prefix must
        come earlier."""
        index: dict[tuple[int, ...], int] = {}
        parents, ranks = [], []
        for path in paths:
            path = tuple(path)
            if not path or path in index:
                raise ValueError(f"rank path {list(path)} is empty or repeated")
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"rank path {list(path)} comes before its parent")
            index[path] = len(parents)
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
            ranks.append(path[-1])
        return cls(parents, ranks, scores)

    @classmethod
    def from_level_counts(
        cls,
        counts: Sequence[int],
        k: int = 8,
        rank_prior: Sequence[float] = RANK_PRIOR,
    ) -> TreeTemplate:
        """Fill each level with the best-scoring children of the level above.

        A node's score is the product of ``rank_prior`` along its rank path,
        so high ranks collect the children and the depth. A level asking for
        more nodes than its parents have ranks (``k``) is clipped.
        """
        if not 1 <= k <= len(rank_prior):
            raise ValueError(f"k={k}: need 1 <= k <= {len(rank_prior)} rank priors")
        if any(not 0.0 < p < 1.0 for p in rank_prior[:k]):
            raise ValueError("rank priors must lie strictly between 0 and 1")
        log_prior = [math.log(p) for p in rank_prior[:k]]
        # (log score, rank path) of every chosen node, level by level.
        chosen: list[tuple[float, tuple[int, ...]]] = []
        frontier: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
        for count in counts:
            cands = [
                (s + log_prior[r], path + (r,))
                for s, path in frontier
                for r in range(k)
            ]
            # Ties go to the earlier parent, then the lower rank: deterministic.
            cands.sort(key=lambda c: -c[0])
            frontier = cands[:count]
            if not frontier:
                break
            chosen.extend(frontier)
        # Best first. A child scores strictly below its parent, so this order
        # is topological; ties are broken by depth to keep it that way.
        chosen.sort(key=lambda c: (-c[0], len(c[1])))
        return cls.from_rank_paths([path for _, path in chosen],
                                   [math.exp(sc) for sc, _ in chosen])

    @classmethod
    def from_spec(cls, spec: str, k: int = 8) -> TreeTemplate:
        """From a preset name or level counts (see :func:`parse_level_counts`);
        a measured preset keeps its paths with ranks below ``k``; a template
        file (``*.json``, as written by ``specplug reader optimize-tree``)
        gives its shape exactly (a ValueError if it uses a rank >= ``k``)."""
        spec = spec.strip()
        if spec in MEASURED:
            kept = [(p, f) for p, f in MEASURED[spec] if max(p) < k]
            return cls.from_rank_paths([p for p, _ in kept], [f for _, f in kept])
        if spec.endswith(".json"):
            template = load_template_file(spec)
            if template.max_rank >= k:
                # the drafter reads ranks 0..k-1 only: a higher rank would
                # index past the top-k row mid-serving
                raise ValueError(f"template file {spec!r} uses rank {template.max_rank}, "
                                 f"but topk={k} gives ranks 0..{k - 1}")
            return template
        return cls.from_level_counts(parse_level_counts(spec), k)

    # ------------------------------------------------------------ shape
    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def max_rank(self) -> int:
        return max(self.ranks, default=-1)

    def level_sizes(self) -> list[int]:
        sizes = [0] * self.depth
        for d in self.depths:
            sizes[d - 1] += 1
        return sizes

    def rank_paths(self) -> list[tuple[int, ...]]:
        paths: list[tuple[int, ...]] = []
        for p, r in zip(self.parents, self.ranks):
            paths.append((paths[p] if p >= 0 else ()) + (r,))
        return paths

    def cut(self, budget: int) -> TreeTemplate:
        """The first ``budget`` nodes: a valid template (parents come first)."""
        n = max(0, budget)
        return TreeTemplate(self.parents[:n], self.ranks[:n],
                            None if self.scores is None else self.scores[:n])

    def greedy_chain(self) -> list[int]:
        """Indices of the all-rank-0 path, root's child first."""
        return list(self._chain)

    def _find_greedy_chain(self) -> tuple[int, ...]:
        chain, want = [], -1
        for i, (p, r) in enumerate(zip(self.parents, self.ranks)):
            if p == want and r == 0:
                chain.append(i)
                want = i
        return tuple(chain)

    # ------------------------------------------------------------ expansion
    def _on(self, device: torch.device) -> tuple:
        """Per-device index tensors: flat ones for the Triton kernel, and per
        level ``(nodes, parent nodes, ranks)`` for the torch fallback."""
        cached = self._device_cache.get(device)
        if cached is None:
            levels = [
                tuple(torch.from_numpy(a).to(device) for a in level)
                for level in self._host_levels
            ]
            flat = (
                torch.tensor(self.parents, dtype=torch.int32, device=device),
                torch.tensor(self.ranks, dtype=torch.int32, device=device),
            )
            cached = self._device_cache[device] = (flat, levels)
        return cached

    def expand(self, table: AdjacencyTable | torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` draft tokens for ``B`` root tokens; -1 where the table
        has no entry (an untouched row) or the parent is already -1."""
        table = getattr(table, "table", table)
        vocab, k = table.shape
        if self.max_rank >= k:
            raise ValueError(f"template uses rank {self.max_rank} but the table has k={k}")
        roots = roots.to(device=table.device, dtype=torch.long).reshape(-1)
        if table.device.type == "cpu":
            return torch.from_numpy(self._expand_numpy(table.numpy(), roots.numpy()))
        flat, levels = self._on(table.device)
        if table.is_cuda and len(self):
            from vllm_specplug.kernels.adjacency import template_expand_triton

            return template_expand_triton(table, roots, *flat, depth=self.depth)
        # Other accelerators: the numpy loop in torch ops.
        out = torch.full((roots.shape[0], len(self)), -1, dtype=torch.long, device=table.device)
        for d, (nodes, parent_nodes, ranks) in enumerate(levels):
            ptok = roots[:, None].expand(-1, len(nodes)) if d == 0 else out[:, parent_nodes]
            ok = (ptok >= 0) & (ptok < vocab)
            # Gather with a clamped index, then mask: -1 must stay -1, not
            # wrap around to the last row.
            child = table[ptok.clamp(0, vocab - 1), ranks].long()
            out[:, nodes] = torch.where(ok, child, -1)
        return out

    def _expand_numpy(self, table: np.ndarray, roots: np.ndarray) -> np.ndarray:
        """The same level loop in numpy: on CPU each torch op costs ~10x more
        dispatch than the work, and there are ~5 ops per level."""
        vocab = table.shape[0]
        out = np.full((roots.shape[0], len(self)), -1, dtype=np.int64)
        for d, (nodes, parent_nodes, ranks) in enumerate(self._host_levels):
            ptok = roots[:, None] if d == 0 else out[:, parent_nodes]
            ok = (ptok >= 0) & (ptok < vocab)
            child = table[np.where(ok, ptok, 0), ranks]
            out[:, nodes] = np.where(ok, child, -1)
        return out

    # ------------------------------------------------------------ to trees
    def to_draft_tree(self, row: Sequence[int], max_nodes: int | None = None,
                      source: str | None = None) -> DraftTree:
        """One expanded row as a DraftTree of at most ``max_nodes`` nodes.

        Nodes with no token (-1) are dropped with their subtrees, and so is a
        node repeating a kept sibling's token (its subtree would repeat the
        sibling's, as children depend only on the parent token). Dropping
        keeps the order, so later template nodes fill the freed slots.
        Nodes carry the template's scores (when it has them) and, with
        ``source``, that source name.
        """
        limit = len(self) if max_nodes is None else max_nodes
        kept = [-1] * len(self)  # template node -> tree node, -1 = dropped
        seen: set[tuple[int, int]] = set()
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        for i, p in enumerate(self.parents):
            if len(tokens) >= limit:
                break
            tok = int(row[i])
            parent = kept[p] if p >= 0 else -1
            if tok < 0 or (p >= 0 and parent < 0) or (parent, tok) in seen:
                continue
            seen.add((parent, tok))
            kept[i] = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            if self.scores is not None:
                scores.append(self.scores[i])
        return DraftTree(tokens, parents, scores if self.scores is not None else None,
                         None if source is None else [source] * len(tokens))

    def chain_tokens(self, row: Sequence[int], max_len: int | None = None) -> list[int]:
        """The greedy (all rank-0) path of an expanded row, up to the first gap."""
        out: list[int] = []
        for i in self._chain[:max_len]:
            if int(row[i]) < 0:
                break
            out.append(int(row[i]))
        return out


def load_template_file(path: str) -> TreeTemplate:
    """A template file: JSON with ``rank_paths`` (best first, each after its
    parent). Any problem is a one-line ValueError naming the file."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            paths = json.load(f)["rank_paths"]
        template = TreeTemplate.from_rank_paths(paths)
    except FileNotFoundError:
        raise ValueError(f"template file {path!r} not found") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"template file {path!r} is not a tree template "
                         f"({' '.join(str(e).split())})") from None
    if not len(template):
        raise ValueError(f"template file {path!r} has no nodes")
    return template
