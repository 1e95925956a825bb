"""Prompt lookup: where did the context's suffix occur before?

The shared lexical retrieval piece: exact n-gram matching of the context's
suffix against earlier prompt + output tokens, in numpy (no numba: importing
numba breaks later vLLM worker starts, see ``plugin._ModulesWithoutLlvm``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def suffix_matches(tokens: np.ndarray, n: int) -> np.ndarray:
    """Start positions ``i`` (ascending) where ``tokens[i:i+n]`` equals the
    last ``n`` tokens and at least one token follows the match."""
    length = tokens.shape[0]
    if n <= 0 or length <= n:
        return np.empty(0, dtype=np.int64)
    # Candidates must leave one token after them, so drop the last n windows'
    # worth of starts: windows start at 0 .. length-n-1.
    windows = sliding_window_view(tokens[: length - 1], n)
    hits = np.all(windows == tokens[length - n :], axis=1)
    return np.flatnonzero(hits)


def longest_matches(
    tokens: np.ndarray, min_n: int, max_n: int
) -> tuple[int, np.ndarray]:
    """The longest suffix length in ``[min_n, max_n]`` that occurs earlier,
    and its start positions (ascending). ``(0, [])`` if none."""
    for n in range(min(max_n, tokens.shape[0] - 1), min_n - 1, -1):
        starts = suffix_matches(tokens, n)
        if starts.size:
            return n, starts
    return 0, np.empty(0, dtype=np.int64)


def continuations(
    tokens: np.ndarray, min_n: int, max_n: int, length: int, max_distinct: int
) -> list[np.ndarray]:
    """Up to ``max_distinct`` continuations of the longest match, distinct in
    their first token, earliest match first (the same first pick as vLLM's
    ``ngram``)."""
    _, begins = match(tokens, min_n, max_n, max_distinct)
    return [tokens[b : b + length] for b in begins]


def match(
    tokens: np.ndarray, min_n: int, max_n: int, max_distinct: int = 1
) -> tuple[int, list[int]]:
    """The longest suffix match's length (0: none) and where up to
    ``max_distinct`` of its continuations begin (distinct first tokens,
    earliest match first). The token before a ``begin`` is the match's
    anchor; the match length is the copy's evidence
    (``sources/copy_path.py``)."""
    n, starts = longest_matches(tokens, min_n, max_n)
    out: list[int] = []
    seen: set[int] = set()
    for s in starts:
        begin = int(s) + n
        first = int(tokens[begin])
        if first in seen:
            continue
        seen.add(first)
        out.append(begin)
        if len(out) >= max_distinct:
            break
    return n, out
