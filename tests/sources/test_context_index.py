"""The maintained n-gram index against a rescan of the whole history."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.sources.context_index import ContextIndex


def _rescan(tokens, key):
    k = len(key)
    return [p for p in range(k - 1, len(tokens) - 1) if tokens[p - k + 1 : p + 1] == list(key)]


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_equals_rescan(seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 4, 200).tolist()
    idx = ContextIndex(max_n=3)
    n = 5
    while n <= len(history):
        idx.sync(np.asarray(history[:n]))
        for k in (1, 2, 3):
            key = history[n - k : n]
            assert idx.ends(key) == _rescan(history[:n], key)
        n += int(rng.integers(1, 6))  # steps accept 0..4 tokens + 1


def test_resync_after_a_diverging_history():
    idx = ContextIndex(2)
    idx.sync([1, 2, 3, 1, 2])
    assert idx.ends([1, 2]) == [1]
    idx.sync([9, 2, 3])  # preempted and resumed with another history
    assert idx.tokens == [9, 2, 3] and idx.ends([2]) == [1]
    assert idx.next_token_counts([2]) == {3: 1}
    assert idx.continuation(0, 5) == [2, 3]
