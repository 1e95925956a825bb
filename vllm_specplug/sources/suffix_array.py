"""A token suffix array: next-token counts of any key over a large corpus.

READER's long-term datastore. A trie over millions of tokens costs too much
memory; a suffix array (one int per corpus token, sorted by the suffix that
starts there) answers the same question -- which tokens followed this key,
and how often -- by two binary searches. Within the key's range the suffixes
are sorted by the token that follows the key too, so the counts are the
lengths of runs in one slice.

Documents are joined with a separator id that is no token (above the
vocabulary), so no key matches across a document boundary and the token
after a document's last key is not counted.

The arrays may be memory-mapped (``numpy.load(mmap_mode="r")``): a query
reads ``O(log n)`` corpus positions plus the key's range.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id and the separator."""
    return np.dtype(np.uint16) if vocab_size < np.iinfo(np.uint16).max else np.dtype(np.uint32)


def join_documents(docs: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Documents -> one token array, each document followed by the separator
    (``vocab_size``, which no token equals)."""
    dtype = token_dtype(vocab_size)
    parts = []
    sep = np.array([vocab_size], dtype=dtype)
    for doc in docs:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(f"token id out of range [0, {vocab_size})")
        parts += [arr.astype(dtype), sep]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes in lexicographic (integer) order,
    by libdivsufsort (``pydivsufsort``)."""
    from pydivsufsort import divsufsort

    if tokens.size == 0:
        return np.zeros(0, dtype=np.int64)
    sa = divsufsort(np.ascontiguousarray(tokens))
    return sa.astype(np.int32 if tokens.size < 2**31 else np.int64, copy=False)


class TokenSuffixArray:
    """Queries over ``tokens`` (separator-joined documents) and its suffix
    array ``sa``."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray, separator: int) -> None:
        if tokens.shape[0] != sa.shape[0]:
            raise ValueError("tokens and suffix array differ in length")
        self.tokens = tokens
        self.sa = sa
        self.separator = int(separator)

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int]], vocab_size: int) -> TokenSuffixArray:
        tokens = join_documents(docs, vocab_size)
        return cls(tokens, build_suffix_array(tokens), vocab_size)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _compare(self, pos: int, key: np.ndarray) -> int:
        """-1 / 0 / 1: the suffix at ``pos`` cut to ``len(key)`` vs ``key``
        (a suffix shorter than the key and equal so far sorts first)."""
        window = self.tokens[pos : pos + key.shape[0]]
        n = window.shape[0]
        diff = np.flatnonzero(window != key[:n])
        if diff.size:
            i = diff[0]
            return -1 if window[i] < key[i] else 1
        return -1 if n < key.shape[0] else 0

    def range_of(self, key: Sequence[int], within: tuple[int, int] | None = None
                 ) -> tuple[int, int]:
        """``[lo, hi)``: the suffix-array rows whose suffix starts with ``key``.
        ``within``: a range known to hold them (the range of a prefix of
        ``key``), which a search that extends its key one token at a time
        passes on to search fewer rows."""
        key = np.asarray(key, dtype=np.int64)
        lo, hi = within if within is not None else (0, len(self))
        if key.size == 0:
            return lo, hi
        end = hi
        while lo < hi:  # first row >= key
            mid = (lo + hi) // 2
            if self._compare(int(self.sa[mid]), key) < 0:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, end
        while lo < hi:  # first row > key
            mid = (lo + hi) // 2
            if self._compare(int(self.sa[mid]), key) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def next_token_counts(self, key: Sequence[int], max_rows: int | None = None,
                          within: tuple[int, int] | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens that follow ``key`` in the corpus and how often, most
        frequent first (ties: smaller id first). ``max_rows`` caps the rows
        read for very common keys (the counts are then of the first rows of
        the range, which the suffix order groups by next token: the most
        frequent continuations may be missed, so keep it large)."""
        lo, hi = self.range_of(key, within)
        if max_rows is not None:
            hi = min(hi, lo + max_rows)
        if hi <= lo:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        after = self.sa[lo:hi].astype(np.int64) + len(key)
        after = after[after < len(self)]
        nxt = self.tokens[after].astype(np.int64)
        nxt = nxt[nxt != self.separator]
        if nxt.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ids, counts = np.unique(nxt, return_counts=True)
        order = np.lexsort((ids, -counts))
        return ids[order], counts[order]

    def next_tokens_backoff(self, context: Sequence[int], max_key: int,
                            min_key: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
        """READER's lookup: the key is the last ``max_key`` tokens of
        ``context``; while it is absent, drop its first token and retry.
        Returns (ids, counts, key length used; 0 if nothing matched)."""
        ctx = np.asarray(context, dtype=np.int64)
        for n in range(min(max_key, ctx.shape[0]), min_key - 1, -1):
            ids, counts = self.next_token_counts(ctx[ctx.shape[0] - n :])
            if ids.size:
                return ids, counts, n
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0
