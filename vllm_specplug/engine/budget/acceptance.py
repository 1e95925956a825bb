"""How likely a draft node is to be accepted, from the outcomes observed.

Model: ``P(node accepted | parent accepted)`` by depth and sibling rank
(and by the node's source where the tree names one), kept for the whole
engine, per source and per request. A request's estimate is shrunk toward
its source's (or the engine's) while it has few observations; old evidence
decays (a server's workload changes over its life). A node's unconditional
acceptance is the product of the conditional estimates along its path, so
it is never above its parent's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specplug.engine.tree import DraftTree


@dataclass
class _Rates:
    """Counts of (accepted, seen) per (depth, rank) bucket."""

    acc: np.ndarray
    seen: np.ndarray

    @classmethod
    def empty(cls, depths: int, ranks: int) -> _Rates:
        return cls(np.zeros((depths, ranks)), np.zeros((depths, ranks)))

    def decay(self, factor: float) -> None:
        self.acc *= factor
        self.seen *= factor


class AcceptanceModel:
    """``P(node accepted | parent accepted)`` by depth and sibling rank, and
    by the node's source where the tree names one (``DraftTree.sources``).

    A source is the method's own word for how sure a node is: `pld` names
    its chain by the length of the context match it copies (a 4-token match
    is accepted far more often than a 1-token one), `graft`/`respec` their
    retrieved nodes. Without sources every node of a depth and rank shares
    one estimate, so the cut could not tell a sure copy from a guess, and
    would verify weak matches' nodes along with the sure ones, paying rows
    for tokens a shorter draft gets as well. A source's
    estimates are shrunk toward the engine's pooled ones while it has little
    evidence (``source_weight`` observations), a request's toward its
    source's (``request_weight``)."""

    def __init__(self, max_depth: int = 8, max_rank: int = 4, prior: float = 0.3,
                 prior_weight: float = 2.0, request_weight: float = 8.0,
                 half_life: float = 2000.0, source_weight: float = 8.0) -> None:
        self.max_depth, self.max_rank = max_depth, max_rank
        self.prior, self.prior_weight = prior, prior_weight
        self.request_weight = request_weight
        self.source_weight = source_weight
        # forget old evidence slowly: the workload changes over a server's life
        self._decay = 0.5 ** (1.0 / half_life)
        self.engine = _Rates.empty(max_depth, max_rank)
        self.requests: dict[str, _Rates] = {}
        self.sources: dict[str, _Rates] = {}
        self.request_sources: dict[str, dict[str, _Rates]] = {}

    def _bucket(self, depth: int, rank: int) -> tuple[int, int]:
        return min(depth, self.max_depth) - 1, min(rank, self.max_rank - 1)

    def rates(self, req_id: str | None, source: str | None = None) -> np.ndarray:
        """``[max_depth, max_rank]`` conditional acceptance estimates (of the
        nodes of ``source``, if given)."""
        e = self.engine
        base = (e.acc + self.prior * self.prior_weight) / (e.seen + self.prior_weight)
        if source is None:
            r = self.requests.get(req_id) if req_id is not None else None
        else:
            s = self.sources.get(source)
            if s is not None:
                base = (s.acc + base * self.source_weight) / (s.seen + self.source_weight)
            r = self.request_sources.get(req_id, {}).get(source) if req_id is not None else None
        if r is None:
            return base
        return (r.acc + base * self.request_weight) / (r.seen + self.request_weight)

    def node_probs(self, tree: DraftTree, req_id: str | None = None) -> np.ndarray:
        """Unconditional acceptance probability of every node (product of the
        conditional estimates along its path); never above its parent's."""
        by_source: dict[str | None, np.ndarray] = {}
        ranks = sibling_ranks(tree)
        out = np.empty(len(tree))
        for i, p in enumerate(tree.parents):
            src = tree.sources[i] if tree.sources is not None else None
            rates = by_source.get(src)
            if rates is None:
                rates = by_source[src] = self.rates(req_id, src)
            depth = 1 if p < 0 else _depth_of(tree, i)
            d, r = self._bucket(depth, ranks[i])
            out[i] = rates[d, r] * (1.0 if p < 0 else out[p])
        return out

    def observe(self, req_id: str, outcomes: list[tuple]) -> None:
        """``(depth, rank, accepted)`` or ``(depth, rank, accepted, source)``
        of nodes whose parent was accepted."""
        if not outcomes:
            return
        factor = self._decay ** len(outcomes)
        self.engine.decay(factor)
        for rates in self.sources.values():
            rates.decay(factor)
        req = self._table(self.requests, req_id)
        for depth, rank, ok, *rest in outcomes:
            d, r = self._bucket(depth, rank)
            tables = [self.engine, req]
            src = rest[0] if rest else None
            if src is not None:
                tables.append(self._table(self.sources, src))
                tables.append(self._table(self.request_sources.setdefault(req_id, {}), src))
            for rates in tables:
                rates.seen[d, r] += 1
                rates.acc[d, r] += ok

    def _table(self, tables: dict[str, _Rates], key: str) -> _Rates:
        """``tables[key]``, created empty on first use (not allocated on
        every lookup, as ``setdefault`` would: this runs per outcome)."""
        rates = tables.get(key)
        if rates is None:
            rates = tables[key] = _Rates.empty(self.max_depth, self.max_rank)
        return rates

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.request_sources.pop(req_id, None)


def _depth_of(tree: DraftTree, i: int) -> int:
    d = 0
    while i >= 0:
        d += 1
        i = tree.parents[i]
    return d


def sibling_ranks(tree: DraftTree) -> list[int]:
    """Rank of every node among its siblings: by score where the tree has
    scores (best first), else by the order the method laid them out (methods
    put their most likely child first)."""
    ranks = [0] * len(tree)
    for kids in tree.children():
        if tree.scores is not None:
            kids = sorted(kids, key=lambda c: -tree.scores[c])
        for r, c in enumerate(kids):
            ranks[c] = r
    return ranks

