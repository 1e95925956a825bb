"""Draft trees: the one shape every method hands to the verifier.

A tree travels to vLLM's scheduler as a flat token list, so its nodes are kept
in a topological order (every parent before its children). Any prefix of such
an order is itself a valid tree, which is what makes it safe for the
scheduler to cut the list short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import heapq

import numpy as np


@dataclass
class DraftTree:
    """Draft tokens plus a parent index per token.

    ``parents[i] == -1`` means the node hangs off the root, i.e. the last
    verified token; otherwise ``parents[i] < i``.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] | None = None
    """Optional per-node score, higher is better (e.g. a drafter's cumulative
    log-probability); a cost-aware budget cuts the tree by it."""
    sources: list[str] | None = None
    """Optional per-node source name (which drafter made the node); the
    runner counts accepted tokens per source."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for name in ("scores", "sources"):
            meta = getattr(self, name)
            if meta is not None and len(meta) != len(self.tokens):
                raise ValueError(f"{name} and tokens differ in length")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], source: str | None = None) -> DraftTree:
        """``tokens`` one after another; every node of ``source`` if given."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)),
                   sources=None if source is None else [source] * len(tokens))

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def chain_prefix(self) -> int:
        """How many leading nodes form a chain from the root (node ``i``'s
        parent is node ``i - 1``): ``len(self)`` for a chain."""
        for i, p in enumerate(self.parents):
            if p != i - 1:
                return i
        return len(self.parents)

    def truncated(self, n: int) -> DraftTree:
        """The first ``n`` nodes (a prefix of a topological order is a tree)."""
        return self.select(range(min(n, len(self))))

    def select(self, nodes) -> DraftTree:
        """The sub-tree of ``nodes``, in that order (each one's parent must
        come before it, or be the root), metadata included."""
        nodes = list(nodes)
        index = {n: i for i, n in enumerate(nodes)}
        return DraftTree(
            [self.tokens[n] for n in nodes],
            [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in nodes],
            None if self.scores is None else [self.scores[n] for n in nodes],
            None if self.sources is None else [self.sources[n] for n in nodes],
        )

    def validate(self) -> None:
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: not topological")

    def depths(self) -> np.ndarray:
        """Depth of each node; children of the root have depth 1."""
        d = np.empty(len(self.parents), dtype=np.int64)
        for i, p in enumerate(self.parents):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """``[n+1, n+1]`` bool: row/col 0 is the root, row i+1 is node i.

        ``mask[a, b]`` is True when row ``a`` may attend to row ``b``: ``b`` is
        ``a`` itself or one of its ancestors (the root is everyone's ancestor).
        """
        n = len(self.parents)
        m = np.zeros((n + 1, n + 1), dtype=bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            m[row] = m[p + 1]
            m[row, row] = True
        m[0, 1:] = False
        return m

    def children(self) -> list[list[int]]:
        """Children lists; index 0 is the root, index i+1 is node i."""
        ch: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for i, p in enumerate(self.parents):
            ch[p + 1].append(i)
        return ch

    def follow(self, tokens) -> tuple[int, int]:
        """Walk down from the root along ``tokens`` (e.g. what the target
        accepted): the deepest node reached (-1: the root) and its depth,
        i.e. how many of ``tokens`` the tree holds as a path."""
        children = self.children()
        node, depth = -1, 0
        for tok in tokens:
            nxt = next((c for c in children[node + 1] if self.tokens[c] == tok), None)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        return node, depth

    def first_path(self) -> DraftTree:
        """The chain that follows the first child at every level."""
        children = self.children()
        path, cur = [], -1
        while children[cur + 1]:
            cur = children[cur + 1][0]
            path.append(cur)
        return self.select(path)


def normalize_tree(tree: DraftTree, budget: int) -> DraftTree:
    """Make a method's tree safe to verify: topological, no two siblings with
    the same token (the sampling walk sums sibling probabilities, so a
    duplicate would count twice) and at most ``budget`` nodes.

    A duplicate sibling is unified onto the first one: its children hang
    under that node (they may be a different drafter's continuation) and
    the first one's metadata wins. A node with an invalid parent is dropped
    with its subtree. Over budget, a tree with ``scores`` keeps its best
    nodes (best-first from the root, so every kept node's parent is kept),
    one without keeps its first ``budget`` nodes. The order of the kept
    nodes is the method's.
    """
    canon: dict[int, int] = {}  # node -> the node it is (itself or unified onto)
    first: dict[tuple[int, int], int] = {}
    order: list[int] = []
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        if not -1 <= p < i or (p >= 0 and p not in canon):
            continue
        key = (canon[p] if p >= 0 else -1, int(tok))
        if key in first:
            canon[i] = first[key]
            continue
        first[key] = canon[i] = i
        order.append(i)
    if len(order) > budget:
        if tree.scores is None:
            order = order[:budget]
        else:
            order = sorted(_best_first(tree, order, canon, budget))
    index = {n: k for k, n in enumerate(order)}
    return DraftTree(
        [int(tree.tokens[n]) for n in order],
        [index[canon[tree.parents[n]]] if tree.parents[n] >= 0 else -1 for n in order],
        None if tree.scores is None else [tree.scores[n] for n in order],
        None if tree.sources is None else [tree.sources[n] for n in order],
    )


def _best_first(tree: DraftTree, order: list[int], canon: dict[int, int],
                budget: int) -> list[int]:
    """The ``budget`` best-scored nodes of ``order`` reachable from the
    root through kept nodes only."""
    kids: dict[int, list[int]] = {}
    for n in order:
        p = tree.parents[n]
        kids.setdefault(canon[p] if p >= 0 else -1, []).append(n)
    heap = [(-tree.scores[n], n) for n in kids.get(-1, [])]
    heapq.heapify(heap)
    kept: list[int] = []
    while heap and len(kept) < budget:
        _, n = heapq.heappop(heap)
        kept.append(n)
        for c in kids.get(n, []):
            heapq.heappush(heap, (-tree.scores[c], c))
    return kept


class TrieBuilder:
    """Merge token sequences and trees into one tree within a budget,
    sharing common prefixes: a (parent, token) pair already present is the
    same node, so what is inserted later hangs under it instead of being
    lost (e.g. a retrieval continuation under a model-drafted node).

    Insert in priority order; the result is laid out depth-first with the
    first-inserted node first, so the most likely path sits in consecutive
    slots and usually needs no KV move after verification. Per-node
    ``scores``/``sources`` are kept (the first insert of a node wins) and
    appear in the built tree when any node has one.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._children: list[dict[int, int]] = [{}]  # node 0 is the root
        self._tokens: list[int] = [-1]
        self._parent: list[int] = [-1]
        self._scores: list[float | None] = [None]
        self._sources: list[str | None] = [None]

    def __len__(self) -> int:
        return len(self._tokens) - 1

    @classmethod
    def from_tree(cls, tree: DraftTree, budget: int) -> TrieBuilder:
        trie = cls(budget)
        trie.insert_tree(tree)
        return trie

    def _child(self, node: int, tok: int, score=None, source=None) -> int | None:
        """The child of ``node`` holding ``tok``, added if the budget allows."""
        nxt = self._children[node].get(tok)
        if nxt is None and len(self) < self.budget:
            nxt = len(self._tokens)
            self._children[node][tok] = nxt
            self._children.append({})
            self._tokens.append(tok)
            self._parent.append(node)
            self._scores.append(score)
            self._sources.append(source)
        return nxt

    def insert(self, seq, under: int = 0, source: str | None = None) -> int:
        """Insert ``seq`` below internal node ``under``; returns nodes added."""
        node, before = under, len(self)
        for tok in seq:
            node = self._child(node, int(tok), source=source)
            if node is None:
                break
        return len(self) - before

    def insert_tree(self, tree: DraftTree, under: int = 0) -> int:
        """Merge ``tree`` below internal node ``under``; returns nodes added.

        Nodes are taken best-first by ``tree.scores`` (in the tree's order
        without scores), each only after its parent: existing nodes cost
        nothing, new ones fill what is left of the budget, and a node that
        does not fit takes its subtree with it.
        """
        children = tree.children()
        before = len(self)
        key = (lambda n: (-tree.scores[n], n)) if tree.scores is not None else (lambda n: (n,))
        heap = [(key(c), c, under) for c in children[0]]
        heapq.heapify(heap)
        while heap:
            _, n, parent = heapq.heappop(heap)
            node = self._child(
                parent, int(tree.tokens[n]),
                None if tree.scores is None else tree.scores[n],
                None if tree.sources is None else tree.sources[n])
            if node is not None:
                for c in children[n + 1]:
                    heapq.heappush(heap, (key(c), c, node))
        return len(self) - before

    def build(self) -> DraftTree:
        order: list[int] = []
        stack = list(reversed(self._children[0].values()))
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(reversed(self._children[n].values()))
        index = {n: i for i, n in enumerate(order)}
        scores = sources = None
        if any(self._scores[n] is not None for n in order):
            scores = [self._scores[n] if self._scores[n] is not None else float("-inf")
                      for n in order]
        if any(self._sources[n] is not None for n in order):
            sources = [self._sources[n] or "" for n in order]
        return DraftTree(
            [self._tokens[n] for n in order],
            [index.get(self._parent[n], -1) for n in order],
            scores, sources,
        )
