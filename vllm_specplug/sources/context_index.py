"""A maintained n-gram index over one request's tokens (prompt + output).

Retrieval from the context asks, every step, "where did these last k tokens
occur before?". Rescanning the whole history each step costs O(length);
this index is extended by the tokens each step adds (``max_n`` dictionary
inserts per token) and answers in O(occurrences). It plays the part of
SAM-Decoding's and ReSpec's suffix automaton for keys of at most ``max_n``
tokens, and of READER's short-term trie.

Positions are *end* positions: ``p`` such that ``tokens[p-k+1 .. p]`` is the
key, so the continuation starts at ``p + 1``.

Footprint: a tuple key, a dict slot and a list entry per token and key
length: about 0.35 KB per token at ``max_n`` 3, 1 KB at 6.
``max_tokens`` bounds it: the index then holds the most recent
``max_tokens`` tokens only; the oldest token leaves as each new one
arrives, with every key that starts at it, so lookups see exactly the
keys that lie wholly inside that window. Positions stay absolute (those
of the request's history). Lookups can also be capped to the most recent
``limit`` occurrences, which bounds the work of a very common key.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ContextIndex:
    def __init__(self, max_n: int = 3, max_tokens: int | None = None) -> None:
        if max_n < 1:
            raise ValueError("max_n must be >= 1")
        if max_tokens is not None and max_tokens < max_n:
            raise ValueError("max_tokens must be >= max_n")
        self.max_n = max_n
        self.max_tokens = max_tokens
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[int] = []  # the window, after _head dropped entries
        self._head = 0
        self.base = 0
        """Absolute position of the oldest token still indexed."""
        self._ends: dict[tuple[int, ...], list[int]] = {}

    @property
    def tokens(self) -> list[int]:
        """The indexed tokens (a copy), oldest first; ``tokens[0]`` is at
        position ``base``."""
        return self._tokens[self._head:]

    @property
    def num_keys(self) -> int:
        """Distinct keys held (the dictionary's size)."""
        return len(self._ends)

    def __len__(self) -> int:
        """Length of the history the index is synced to (not the window)."""
        return self.base + len(self._tokens) - self._head

    def sync(self, history: Sequence[int] | np.ndarray) -> None:
        """Bring the index up to ``history`` (the request's tokens so far).
        Tokens already indexed are assumed unchanged (a request's verified
        history only grows); a shorter or diverging history (a request that
        came back after preemption with another tail) rebuilds the index."""
        n = len(self)
        if len(history) < n or (n and int(history[n - 1]) != self._tokens[-1]):
            self._reset()
            n = 0
        if n == 0 and self.max_tokens is not None and len(history) > self.max_tokens:
            n = self.base = len(history) - self.max_tokens  # older ones would drop at once
        for tok in history[n:]:
            self._append(int(tok))

    def _append(self, tok: int) -> None:
        self._tokens.append(tok)
        p = len(self) - 1
        w = len(self._tokens) - 1
        for k in range(1, min(self.max_n, p - self.base + 1) + 1):
            key = tuple(self._tokens[w - k + 1 : w + 1])
            self._ends.setdefault(key, []).append(p)
        if self.max_tokens is not None and p - self.base + 1 > self.max_tokens:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Forget the oldest token and the keys that start at it. Every
        indexed key lies inside the window, so the one starting at the
        oldest token is its key's earliest entry."""
        i = self._head
        for k in range(1, min(self.max_n, len(self._tokens) - i) + 1):
            key = tuple(self._tokens[i : i + k])
            ends = self._ends[key]
            del ends[0]
            if not ends:
                del self._ends[key]
        self.base += 1
        self._head += 1
        if self._head >= max(64, len(self._tokens) // 2):
            del self._tokens[: self._head]  # compact now and then, not per token
            self._head = 0

    def ends(self, key: Sequence[int], with_continuation: bool = True,
             limit: int | None = None) -> list[int]:
        """End positions of earlier occurrences of ``key`` (ascending). With
        ``with_continuation`` only those followed by at least one token, so
        the occurrence that is the current suffix itself is left out.
        ``limit``: only the most recent ``limit`` of them."""
        if not 1 <= len(key) <= self.max_n:
            raise ValueError(f"key length must be in [1, {self.max_n}]")
        ends = self._ends.get(tuple(int(t) for t in key))
        if not ends:
            return []
        stop = len(ends)
        if with_continuation and ends[-1] == len(self) - 1:
            stop -= 1
        start = 0 if limit is None else max(0, stop - limit)
        return ends[start:stop]

    def continuation(self, end: int, length: int) -> list[int]:
        """Up to ``length`` tokens after position ``end`` (none for a
        position that left the window)."""
        if end + 1 < self.base:
            return []
        i = end + 1 - self.base + self._head
        return self._tokens[i : i + length]

    def next_token_counts(self, key: Sequence[int], limit: int | None = None
                          ) -> dict[int, int]:
        """How often each token followed ``key`` in the history (over its
        most recent ``limit`` occurrences, if given)."""
        counts: dict[int, int] = {}
        shift = self._head - self.base
        for p in self.ends(key, limit=limit):
            t = self._tokens[p + 1 + shift]
            counts[t] = counts.get(t, 0) + 1
        return counts
