"""Draft trees: the one shape every method hands to the verifier.

A tree travels to vLLM's scheduler as a flat token list, so its nodes are kept
in a topological order (every parent before its children). Any prefix of such
an order is itself a valid tree, which is what makes it safe for the
scheduler to cut the list short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def truncated(self, n: int) -> DraftTree:
        return DraftTree(self.tokens[:n], self.parents[:n])

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

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def first_path(self) -> DraftTree:
        """The chain that follows the first child at every level."""
        children = self.children()
        toks, cur = [], -1
        while children[cur + 1]:
            cur = children[cur + 1][0]
            toks.append(self.tokens[cur])
        return DraftTree.chain(toks)


def normalize_tree(tree: DraftTree, budget: int) -> DraftTree:
    """Make a method's tree safe to verify: at most ``budget`` nodes,
    topological, and no two siblings with the same token (the sampling walk
    sums sibling probabilities, so a duplicate would count twice). A node
    whose parent was dropped is dropped with it."""
    keep: list[int] = []
    new_index: dict[int, int] = {}
    seen: set[tuple[int, int]] = set()
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        if len(keep) >= budget:
            break
        if not -1 <= p < i or (p >= 0 and p not in new_index):
            continue
        parent = new_index[p] if p >= 0 else -1
        key = (parent, int(tok))
        if key in seen:
            continue
        seen.add(key)
        new_index[i] = len(keep)
        keep.append(i)
    return DraftTree(
        [int(tree.tokens[i]) for i in keep],
        [new_index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep],
    )


class TrieBuilder:
    """Merge token sequences into one tree, sharing common prefixes.

    Sequences are inserted in priority order; the result is laid out
    depth-first with the first-inserted sequence first, so the most likely
    path sits in consecutive slots and usually needs no KV move after
    verification.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._children: list[dict[int, int]] = [{}]  # node 0 is the root
        self._tokens: list[int] = [-1]
        self._parent: list[int] = [-1]

    def __len__(self) -> int:
        return len(self._tokens) - 1

    def insert(self, seq, under: int = 0) -> int:
        """Insert ``seq`` below internal node ``under``; returns nodes added."""
        node, added = under, 0
        for tok in seq:
            tok = int(tok)
            nxt = self._children[node].get(tok)
            if nxt is None:
                if len(self) >= self.budget:
                    break
                nxt = len(self._tokens)
                self._children[node][tok] = nxt
                self._children.append({})
                self._tokens.append(tok)
                self._parent.append(node)
                added += 1
            node = nxt
        return added

    def build(self) -> DraftTree:
        order: list[int] = []
        stack = list(reversed(self._children[0].values()))
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(reversed(self._children[n].values()))
        index = {n: i for i, n in enumerate(order)}
        tokens = [self._tokens[n] for n in order]
        parents = [index.get(self._parent[n], -1) for n in order]
        return DraftTree(tokens, parents)
