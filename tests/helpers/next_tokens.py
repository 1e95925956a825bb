"""Reference next-token counts for the suffix-array tests."""

from __future__ import annotations

from collections import Counter


def brute_next_tokens(docs, key) -> Counter:
    """How often each token follows ``key`` in ``docs``, by a plain scan."""
    counts: Counter = Counter()
    k = len(key)
    for d in docs:
        for i in range(len(d) - k):
            if list(d[i : i + k]) == list(key):
                counts[d[i + k]] += 1
    return counts
