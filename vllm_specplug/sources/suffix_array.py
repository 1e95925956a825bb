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
        frequent first (ties: smaller id first).

        ``max_rows`` bounds the work for very common keys. A range of more
        rows is read at ``max_rows`` evenly spaced rows (its first and last
        included); the suffix order sorts the range by the next token, so
        every token seen there has its run's exact ends found by binary
        search between neighbouring samples. Counts are then exact for
        every token that follows the key at least ``rows / (max_rows - 1)``
        times (those always reach a sample), and the rarer tokens no
        sample reached are left out. Within the cap the result is the
        exact one."""
        lo, hi = self.range_of(key, within)
        empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if hi <= lo:
            return empty
        n = len(key)
        if max_rows is not None and hi - lo > max(max_rows, 2):
            ids, counts = self._sampled_runs(lo, hi, n, max(max_rows, 2))
        else:
            nxt = self._next_tokens(np.arange(lo, hi), n)
            ids, counts = np.unique(nxt, return_counts=True)
        keep = (ids >= 0) & (ids != self.separator)
        ids, counts = ids[keep], counts[keep]
        if ids.size == 0:
            return empty
        order = np.lexsort((ids, -counts))
        return ids[order], counts[order]

    def _next_tokens(self, rows: np.ndarray, n: int) -> np.ndarray:
        """The token after the ``n``-token key at each suffix-array row
        (-1 where the corpus ends right after the key)."""
        after = self.sa[rows].astype(np.int64) + n
        out = np.full(after.shape, -1, dtype=np.int64)
        inside = after < len(self)
        out[inside] = self.tokens[after[inside]]
        return out

    def _sampled_runs(self, lo: int, hi: int, n: int, samples: int
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Next tokens of ``[lo, hi)`` seen at ``samples`` evenly spaced
        rows, each with the exact length of its run (the rows of a key's
        range are sorted by the next token)."""
        rows = lo + (np.arange(samples, dtype=np.int64) * (hi - 1 - lo)) // (samples - 1)
        seen = self._next_tokens(rows, n)
        change = np.flatnonzero(seen[1:] != seen[:-1])  # a run ends between j and j+1
        # first row past the run of seen[j], and first row of seen[j+1]'s run
        ends = self._first_above(rows[change], rows[change + 1], seen[change], n)
        starts = self._first_above(rows[change], rows[change + 1], seen[change + 1] - 1, n)
        first = np.concatenate([[0], change + 1])  # sample index opening each run
        run_start = np.concatenate([[lo], starts])
        run_end = np.concatenate([ends, [hi]])
        return seen[first], run_end - run_start

    def _first_above(self, low: np.ndarray, high: np.ndarray, threshold: np.ndarray,
                     n: int) -> np.ndarray:
        """Per gap: the first row in ``(low, high]`` whose next token is
        above ``threshold``, given that ``low``'s is not and ``high``'s is
        (binary searches run side by side)."""
        low, high = low.copy(), high.copy()
        while True:
            open_ = high - low > 1
            if not open_.any():
                return high
            mid = (low + high) // 2
            above = self._next_tokens(mid, n) > threshold
            high = np.where(open_ & above, mid, high)
            low = np.where(open_ & ~above, mid, low)

    def next_tokens_backoff(self, context: Sequence[int], max_key: int,
                            min_key: int = 1, max_rows: int | None = None
                            ) -> tuple[np.ndarray, np.ndarray, int]:
        """READER's lookup: the key is the last ``max_key`` tokens of
        ``context``; while it is absent, drop its first token and retry.
        Returns (ids, counts, key length used; 0 if nothing matched).
        ``max_rows``: as in :meth:`next_token_counts`."""
        ctx = np.asarray(context, dtype=np.int64)
        for n in range(min(max_key, ctx.shape[0]), min_key - 1, -1):
            ids, counts = self.next_token_counts(ctx[ctx.shape[0] - n :], max_rows)
            if ids.size:
                return ids, counts, n
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0
