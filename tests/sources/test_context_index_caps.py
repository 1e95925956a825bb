"""The n-gram index's bounds: a lookup capped to the most recent
occurrences, and a window of the most recent tokens, each against a
rescan of the history."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from vllm_specplug.sources.context_index import ContextIndex


def _rescan(tokens, key, first=0):
    """End positions of ``key`` lying wholly at or after ``first`` and
    followed by a token."""
    k = len(key)
    return [p for p in range(first + k - 1, len(tokens) - 1)
            if tokens[p - k + 1 : p + 1] == list(key)]


def test_a_key_with_many_hits_examines_only_the_limit():
    history = [5] * 50_000 + [1]
    idx = ContextIndex(max_n=2)
    idx.sync(history)
    ends = idx.ends([5], limit=100)
    assert ends == list(range(49_900, 50_000))  # the most recent, ascending
    counts = idx.next_token_counts([5], limit=100)
    assert counts == {5: 99, 1: 1}  # 100 occurrences counted, not 50,000


@pytest.mark.parametrize("seed", range(4))
def test_limit_takes_the_most_recent_occurrences(seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 5, 300).tolist()
    idx = ContextIndex(max_n=3)
    idx.sync(history)
    for k in (1, 2, 3):
        key = history[len(history) - k :]
        full = _rescan(history, key)
        assert idx.ends(key) == full  # no limit: every occurrence
        for limit in (1, 3, 1000):
            assert idx.ends(key, limit=limit) == full[-limit:]
            want = Counter(history[p + 1] for p in full[-limit:])
            assert idx.next_token_counts(key, limit=limit) == dict(want)


@pytest.mark.parametrize("seed", range(4))
def test_window_equals_a_rescan_of_the_recent_tokens(seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 4, 600).tolist()
    cap = 50
    idx = ContextIndex(max_n=3, max_tokens=cap)
    n = 5
    while n <= len(history):
        idx.sync(np.asarray(history[:n]))
        first = max(0, n - cap)
        assert idx.base == first and idx.tokens == history[first:n] and len(idx) == n
        for k in (1, 2, 3):
            key = history[n - k : n]
            ends = idx.ends(key)
            assert ends == _rescan(history[:n], key, first)
            for p in ends:
                assert idx.continuation(p, 4) == history[p + 1 : min(p + 5, n)]
        n += int(rng.integers(1, 6))


def test_window_memory_is_bounded_at_the_cap():
    rng = np.random.default_rng(0)
    history = rng.integers(0, 1000, 20_000).tolist()
    cap, max_n = 500, 4
    idx = ContextIndex(max_n=max_n, max_tokens=cap)
    for n in range(1, len(history) + 1, 7):
        idx.sync(history[:n])
        assert len(idx.tokens) <= cap
        assert len(idx._tokens) <= 2 * cap + 64  # the list is compacted now and then
        assert sum(len(v) for v in idx._ends.values()) <= cap * max_n
        assert idx.num_keys <= cap * max_n
    unbounded = ContextIndex(max_n=max_n)
    unbounded.sync(history)
    assert unbounded.num_keys > 10 * cap  # what the cap saves here


def test_long_history_after_a_reset_indexes_only_the_window():
    idx = ContextIndex(max_n=2, max_tokens=100)
    idx.sync(list(range(10)) * 100)
    idx.sync([3, 1, 4] * 1000)  # diverges: rebuilt from the last 100 tokens
    assert idx.base == 2900 and len(idx) == 3000
    assert idx.ends([3, 1]) == _rescan([3, 1, 4] * 1000, [3, 1], 2900)
    assert idx.continuation(10, 3) == []  # left the window


def test_window_smaller_than_a_key_is_refused():
    with pytest.raises(ValueError):
        ContextIndex(max_n=4, max_tokens=3)
