"""A maintained n-gram index over one request's tokens (prompt + output).

Retrieval from the context asks, every step, "where did these last k tokens
occur before?". Rescanning the whole history each step costs O(length);
this index is extended by the tokens each step adds (``max_n`` dictionary
inserts per token) and answers in O(occurrences). It plays the part of
SAM-Decoding's and ReSpec's suffix automaton for keys of at most ``max_n``
tokens, and of READER's short-term trie.

Positions are *end* positions: ``p`` such that ``tokens[p-k+1 .. p]`` is the
key, so the continuation starts at ``p + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ContextIndex:
    def __init__(self, max_n: int = 3) -> None:
        if max_n < 1:
            raise ValueError("max_n must be >= 1")
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def sync(self, history: Sequence[int] | np.ndarray) -> None:
        """Bring the index up to ``history`` (the request's tokens so far).
        Tokens already indexed are assumed unchanged (a request's verified
        history only grows); a shorter or diverging history (a request that
        came back after preemption with another tail) rebuilds the index."""
        n = len(self.tokens)
        if len(history) < n or (n and int(history[n - 1]) != self.tokens[-1]):
            self.tokens, self._ends = [], {}
            n = 0
        for tok in history[n:]:
            self._append(int(tok))

    def _append(self, tok: int) -> None:
        self.tokens.append(tok)
        p = len(self.tokens) - 1
        for k in range(1, min(self.max_n, p + 1) + 1):
            key = tuple(self.tokens[p - k + 1 : p + 1])
            self._ends.setdefault(key, []).append(p)

    def ends(self, key: Sequence[int], with_continuation: bool = True) -> list[int]:
        """End positions of earlier occurrences of ``key`` (ascending). With
        ``with_continuation`` only those followed by at least one token, so
        the occurrence that is the current suffix itself is left out."""
        if not 1 <= len(key) <= self.max_n:
            raise ValueError(f"key length must be in [1, {self.max_n}]")
        ends = self._ends.get(tuple(int(t) for t in key), [])
        if with_continuation and ends and ends[-1] == len(self.tokens) - 1:
            return ends[:-1]
        return list(ends)

    def continuation(self, end: int, length: int) -> list[int]:
        return self.tokens[end + 1 : end + 1 + length]

    def next_token_counts(self, key: Sequence[int]) -> dict[int, int]:
        """How often each token followed ``key`` in the history."""
        counts: dict[int, int] = {}
        for p in self.ends(key):
            t = self.tokens[p + 1]
            counts[t] = counts.get(t, 0) + 1
        return counts
