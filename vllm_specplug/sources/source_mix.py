"""Drafts from several sources in one tree, each node scored on one scale.

A method that asks several drafters for each request (a copy of the
context, a suffix tree, a model head) gets trees whose scores mean
different things: a count share, a copy's learned confidence, a head's
probability. Each is a *claimed* chance that the node is accepted; how far
a source's claims hold differs per workload and per request. ``SourceMix``
learns a factor per source, per request (shrunk toward the source's factor
over all requests while a request has little evidence), from what the
target then produced, and merges the trees by calibrated chance:

* **Truth, not verification.** A node is judged against the tokens the
  target produced after the step (``judge``), whether or not the budget
  let it be verified: a node the budget cut still tells whether its source
  was right. Nodes deeper than the tokens known and below a right path are
  not judged.
* **One scale.** ``merge`` multiplies each node's claim by its source's
  factor (capped at 1, and at its parent's: a node is never likelier than
  its parent), then keeps the ``budget`` likeliest nodes, every kept
  node's parent kept, best path laid out first.

Only counts are kept (no tokens), so the factors may be shared across
tenants without carrying anyone's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specplug.engine.tree import DraftTree, TrieBuilder, normalize_tree


@dataclass
class _Evidence:
    """Decayed sums of claimed and realised acceptance."""

    expected: float = 0.0
    realised: float = 0.0

    def add(self, expected: float, realised: float, decay: float) -> None:
        self.expected = self.expected * decay + expected
        self.realised = self.realised * decay + realised


def judge(tree: DraftTree, truth: Sequence[int]) -> list[bool | None]:
    """Per node: True if the target produced it (it lies on ``truth``, the
    tokens after the tree's root), False if it or an ancestor differs from
    ``truth``, None where ``truth`` is too short to tell."""
    out: list[bool | None] = []
    depth = tree.depths() if len(tree) else np.zeros(0, dtype=int)
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        up = True if p < 0 else out[p]
        d = int(depth[i])
        if up is False:
            out.append(False)
        elif up is None or d > len(truth):
            out.append(None)
        else:
            out.append(int(tok) == int(truth[d - 1]))
    return out


class SourceMix:
    """Per-source, per-request calibration of claimed acceptance, and the
    merge it drives (see the module docstring)."""

    def __init__(self, request_weight: float = 4.0, source_weight: float = 8.0,
                 half_life: float = 500.0) -> None:
        self.request_weight = request_weight
        """Expected accepted nodes after which a request's own evidence
        weighs as much as its source's over all requests."""
        self.source_weight = source_weight
        """The same, for a source's evidence against the prior factor 1."""
        self._decay = 0.5 ** (1.0 / half_life)
        self.sources: dict[str, _Evidence] = {}
        self.requests: dict[str, dict[str, _Evidence]] = {}
        # per request: its last merged tree, each node's (claim, source), and
        # the history length it was drafted after
        self._last: dict[str, tuple[DraftTree, list[tuple[float, str]], int]] = {}

    def factor(self, req_id: str, source: str) -> float:
        """How far ``source``'s claims hold for ``req_id`` (1: as claimed)."""
        g = self.sources.get(source, _Evidence())
        base = (g.realised + self.source_weight) / (g.expected + self.source_weight)
        r = self.requests.get(req_id, {}).get(source)
        if r is None:
            return base
        return (r.realised + base * self.request_weight) / (r.expected + self.request_weight)

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._last.pop(req_id, None)

    def observe(self, req_id: str, token_ids: Sequence[int]) -> dict[str, tuple[float, int]]:
        """Judge the request's last merged tree against the tokens verified
        since it was drafted; returns ``{source: (expected, accepted)}``."""
        last = self._last.pop(req_id, None)
        if last is None:
            return {}
        tree, claims, base = last
        truth = token_ids[base:]
        if not len(truth):
            return {}
        seen: dict[str, list[float]] = {}
        for ok, (claim, family) in zip(judge(tree, truth), claims):
            if ok is not None:
                e = seen.setdefault(family, [0.0, 0])
                e[0] += claim
                e[1] += int(ok)
        mine = self.requests.setdefault(req_id, {})
        for family, (expected, realised) in seen.items():
            self.sources.setdefault(family, _Evidence()).add(expected, realised, self._decay)
            mine.setdefault(family, _Evidence()).add(expected, realised, 1.0)
        return {f: (e, int(r)) for f, (e, r) in seen.items()}

    def merge(self, req_id: str, drafts: Sequence[tuple[str, DraftTree]], budget: int,
              history_len: int) -> DraftTree | None:
        """The ``budget`` likeliest nodes of ``drafts`` (``(source, tree)``,
        each tree's ``scores`` its claimed chances) by calibrated chance,
        as one tree; remembered to be judged at the next ``observe``.
        Node names are ``source`` or ``source:<the tree's own name>``."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        claims: list[tuple[float, str]] = []  # the source's own claim, and the source
        names: list[str] = []
        for source, tree in drafts:
            if tree is None or not len(tree):
                continue
            f = self.factor(req_id, source)
            offset = len(tokens)
            for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
                claim = min(1.0, max(0.0, float(tree.scores[i])))
                score = min(1.0, claim * f)
                if p >= 0:
                    score = min(score, scores[offset + p])
                tokens.append(int(tok))
                parents.append(-1 if p < 0 else offset + p)
                scores.append(score)
                claims.append((claim, source))
                own = tree.sources[i] if tree.sources is not None else None
                names.append(f"{source}:{own}" if own else source)
        if not tokens or budget <= 0:
            return None
        # a node two sources drafted is unified onto the first one listed:
        # list the likelier copy first so it keeps its own score and name
        order = _likeliest_first(parents, scores)
        index = {n: k for k, n in enumerate(order)}
        union = DraftTree([tokens[n] for n in order],
                          [-1 if parents[n] < 0 else index[parents[n]] for n in order],
                          [scores[n] for n in order], [names[n] for n in order])
        by_path: dict[tuple[int, ...], tuple[float, str]] = {}
        for k, path in enumerate(_paths(union)):
            by_path.setdefault(path, claims[order[k]])
        best = normalize_tree(union, budget)
        tree = TrieBuilder.from_tree(best, budget).build()  # best path first
        self._last[req_id] = (tree, [by_path[p] for p in _paths(tree)], history_len)
        return tree


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root."""
    out: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens, tree.parents):
        out.append((out[p] if p >= 0 else ()) + (int(tok),))
    return out


def _likeliest_first(parents: list[int], scores: list[float]) -> list[int]:
    """A topological order (each node after its parent) that lists
    siblings' subtrees likeliest first."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    order: list[int] = []
    stack = sorted(children[0], key=lambda n: scores[n])
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(sorted(children[n + 1], key=lambda c: scores[c]))
    return order
