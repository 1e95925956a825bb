"""Drafts from several sources in one tree, each node scored on one scale.

A method that asks several drafters for each request (a copy of the
context, a suffix tree, a model head) gets trees whose scores mean
different things: a count share, a copy's learned confidence, a head's
probability. Each is a *claimed* chance that the node is accepted; how far
a source's claims hold differs per workload and per request. ``SourceMix``
learns a factor per source, per request (shrunk toward the source's factor
over all requests while a request has little evidence), from what the
target then produced, and merges the trees by calibrated chance:

* **Truth, not verification.** Each source's own tree is judged against
  the tokens the target produced after the step (``judge``), whether or
  not the budget let its nodes into the merged tree: a node the budget cut,
  or one another source also drafted, still tells whether its source was
  right. A node is judged only where its parent was right, against the
  source's chance of it *given* its parent: nodes below a wrong parent say
  nothing about that chance, and nodes past the tokens known are left out
  without bias (whether they are known depends on what was verified).
* **One scale.** ``merge`` scores a node by its source's chance of it
  given its parent, times the source's factor (capped at 1), times the
  parent's score: a node is never likelier than its parent. It keeps the
  ``budget`` likeliest nodes, every kept node's parent kept, best path
  laid out first.

A request's own evidence decays (``request_half_life`` judged steps), so a
request whose text changes kind (prose, then code) follows the change.
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


@dataclass
class Judged:
    """One source's trees at one step, judged: ``expected`` the sum of its
    own chances of its judged nodes, ``accepted`` how many of them the
    target produced, ``added`` how many of those the merged tree named
    after it (no cheaper source drafted them)."""

    expected: float = 0.0
    accepted: int = 0
    added: int = 0


@dataclass
class _Drafted:
    """What ``merge`` drafted for a request, kept to be judged: each
    source's own tree with its chances given the parent, the merged tree
    and each of its nodes' naming source, the history length before it."""

    own: list[tuple[str, DraftTree, list[float]]]
    merged: DraftTree
    named: list[str]
    history_len: int


def judge(tree: DraftTree, truth: Sequence[int]) -> list[bool | None]:
    """Per node, given its parent was right: True if the target produced it
    (it lies on ``truth``, the tokens after the tree's root), False if not;
    None where that is not known (its parent was wrong, or ``truth`` ends
    before it). Judging a node only under a right parent is what keeps the
    estimate fair to deep trees: whether a node below a right parent is
    known depends on what was verified, never on whether it is right."""
    out: list[bool | None] = []
    depth = tree.depths() if len(tree) else np.zeros(0, dtype=int)
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        d = int(depth[i])
        if (p >= 0 and out[p] is not True) or d > len(truth):
            out.append(None)
        else:
            out.append(int(tok) == int(truth[d - 1]))
    return out


class SourceMix:
    """Per-source, per-request calibration of claimed acceptance, and the
    merge it drives (see the module docstring)."""

    def __init__(self, request_weight: float = 4.0, source_weight: float = 8.0,
                 half_life: float = 500.0, request_half_life: float = 32.0) -> None:
        self.request_weight = request_weight
        """Expected accepted nodes after which a request's own evidence
        weighs as much as its source's over all requests."""
        self.source_weight = source_weight
        """The same, for a source's evidence against the prior factor 1."""
        self._decay = 0.5 ** (1.0 / half_life)
        self._request_decay = 0.5 ** (1.0 / request_half_life)
        self.sources: dict[str, _Evidence] = {}
        self.requests: dict[str, dict[str, _Evidence]] = {}
        self._last: dict[str, _Drafted] = {}
        self._pooled: dict[str, tuple[list, dict, list]] = {}
        """Per request, the drafts ``expected`` last pooled and their pool,
        for the step's ``merge`` to start from (it adds the drafts that
        come after them) instead of pooling them again."""

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
        self._pooled.pop(req_id, None)

    def observe(self, req_id: str, token_ids: Sequence[int]) -> dict[str, Judged]:
        """Judge the trees drafted for the request's last step against the
        tokens verified since; returns what each source drafted right."""
        last = self._last.pop(req_id, None)
        if last is None:
            return {}
        truth = token_ids[last.history_len:]
        if not len(truth):
            return {}
        out: dict[str, Judged] = {}
        for source, tree, given in last.own:
            judged = out.setdefault(source, Judged())
            for ok, claim in zip(judge(tree, truth), given):
                if ok is not None:
                    judged.expected += claim
                    judged.accepted += int(ok)
        for ok, source in zip(judge(last.merged, truth), last.named):
            if ok and source in out:
                out[source].added += 1
        mine = self.requests.setdefault(req_id, {})
        for source, j in out.items():
            self.sources.setdefault(source, _Evidence()).add(j.expected, j.accepted, self._decay)
            mine.setdefault(source, _Evidence()).add(j.expected, j.accepted, self._request_decay)
        return out

    def expected(self, req_id: str, drafts: Sequence[tuple[str, DraftTree]],
                 budget: int) -> float:
        """Accepted tokens the ``budget`` likeliest nodes of ``drafts`` are
        expected to give, on the calibrated scale ``merge`` uses: the sum of
        their chances (a node's score is its chance of being accepted, and
        never above its parent's, so those nodes form a tree). Nothing is
        judged; the pool is kept for the request's next ``merge``."""
        nodes, own = self._union(req_id, drafts)
        self._pooled[req_id] = (list(drafts), nodes, own)
        scores = sorted((node[0] for node in nodes.values()), reverse=True)
        return float(sum(scores[:max(0, budget)]))

    def _pool_for_merge(self, req_id: str, drafts: Sequence[tuple[str, DraftTree]]):
        """``_union(drafts)``, from the pool ``expected`` kept where
        ``drafts`` begin with the drafts it pooled (the same trees)."""
        pooled = self._pooled.pop(req_id, None)
        if pooled is not None:
            before, nodes, own = pooled
            n = len(before)
            if n <= len(drafts) and all(a[0] == b[0] and a[1] is b[1]
                                        for a, b in zip(before, drafts)):
                return self._union(req_id, drafts[n:], nodes, own)
        return self._union(req_id, drafts)

    def _union(self, req_id: str, drafts: Sequence[tuple[str, DraftTree]],
               nodes: dict[tuple[int, ...], list] | None = None,
               own: list[tuple[str, DraftTree, list[float]]] | None = None
               ) -> tuple[dict[tuple[int, ...], list], list[tuple[str, DraftTree, list[float]]]]:
        """The trees' nodes by path (``[calibrated chance, node name, naming
        source]``, see ``merge``), and each tree with its chances given the
        parent; added to ``nodes`` and ``own`` where given."""
        nodes = {} if nodes is None else nodes
        own = [] if own is None else own
        for source, tree in drafts:
            if tree is None or not len(tree):
                continue
            f = self.factor(req_id, source)
            given = _given_parent(tree)
            own.append((source, tree, given))
            for i, path in enumerate(_paths(tree)):
                # calibrated, times the parent's chance: never likelier than it
                p = tree.parents[i]
                score = min(1.0, given[i] * f) * (nodes[path[:-1]][0] if p >= 0 else 1.0)
                node = nodes.get(path)
                if node is None:
                    name = tree.sources[i] if tree.sources is not None else None
                    nodes[path] = [score, f"{source}:{name}" if name else source, source]
                else:
                    node[0] = max(node[0], score)
        return nodes, own

    def merge(self, req_id: str, drafts: Sequence[tuple[str, DraftTree]], budget: int,
              history_len: int, chain: bool = False) -> DraftTree | None:
        """The ``budget`` likeliest nodes of ``drafts`` (``(source, tree)``,
        cheapest source first, each tree's ``scores`` its claimed chances)
        by calibrated chance, as one tree (``chain``: the path with the most
        expected accepted tokens); remembered to be judged at the next
        ``observe``. A node several sources drafted takes the highest
        calibrated chance among them and the name of the cheapest (the first
        listed): what a costlier source adds is only what no cheaper one
        drafted. Node names are ``source`` or ``source:<the tree's own name>``."""
        nodes, own = self._pool_for_merge(req_id, drafts)
        if not nodes or budget <= 0:
            return None
        paths = list(nodes)  # each after its parent: every tree is topological
        if chain:
            paths = list(_best_chain(nodes, budget))
        index = {path: k for k, path in enumerate(paths)}
        union = DraftTree([path[-1] for path in paths],
                          [index[path[:-1]] if len(path) > 1 else -1 for path in paths],
                          [nodes[path][0] for path in paths], [nodes[path][1] for path in paths])
        best = normalize_tree(union, budget)
        tree = TrieBuilder.from_tree(best, budget).build()  # best path first
        self._last[req_id] = _Drafted(own, tree, [nodes[p][2] for p in _paths(tree)],
                                      history_len)
        return tree


def _best_chain(nodes: dict[tuple[int, ...], list], budget: int) -> tuple[tuple[int, ...], ...]:
    """The path (as its nodes' paths, root first) of at most ``budget``
    nodes with the largest expected accepted length (the sum of its
    nodes' chances)."""
    gain: dict[tuple[int, ...], float] = {}
    best, best_gain = (), 0.0
    for path, (score, _, _) in nodes.items():
        if len(path) > budget:
            continue
        gain[path] = gain.get(path[:-1], 0.0) + score
        if gain[path] > best_gain:
            best, best_gain = path, gain[path]
    return tuple(best[:d] for d in range(1, len(best) + 1))


def _given_parent(tree: DraftTree) -> list[float]:
    """Each node's claimed chance given its parent (claims clipped to
    [0, 1]; a tree's scores are chances from its root)."""
    claims = [min(1.0, max(0.0, float(c))) for c in tree.scores]
    return [min(1.0, c if p < 0 else c / max(claims[p], 1e-9))
            for c, p in zip(claims, tree.parents)]


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root."""
    out: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens, tree.parents):
        out.append((out[p] if p >= 0 else ()) + (int(tok),))
    return out
