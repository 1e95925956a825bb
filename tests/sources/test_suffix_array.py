"""Suffix-array next-token counts against a brute-force count."""

from __future__ import annotations


import numpy as np
import pytest

from tests.helpers.next_tokens import brute_next_tokens
from vllm_specplug.sources.suffix_array import TokenSuffixArray, token_dtype




@pytest.mark.parametrize("seed", range(6))
def test_counts_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([5, 20, 70000]))  # 70000: the uint32 token path
    docs = [rng.integers(0, min(vocab, 6), rng.integers(0, 60)).tolist()
            for _ in range(rng.integers(1, 12))]
    store = TokenSuffixArray.from_documents(docs, vocab)
    assert store.tokens.dtype == token_dtype(vocab)
    for _ in range(40):
        key = rng.integers(0, min(vocab, 6), rng.integers(1, 5)).tolist()
        ids, counts = store.next_token_counts(key)
        want = brute_next_tokens(docs, key)
        assert dict(zip(ids.tolist(), counts.tolist())) == dict(want)
        # most frequent first, ties by smaller id
        pairs = list(zip((-counts).tolist(), ids.tolist()))
        assert pairs == sorted(pairs)


def test_no_match_across_documents_and_narrowed_search():
    store = TokenSuffixArray.from_documents([[1, 2], [3, 4], [1, 2, 5]], vocab_size=10)
    ids, counts = store.next_token_counts([2])
    assert ids.tolist() == [5] and counts.tolist() == [1]  # [2] then [3] is a boundary
    assert store.next_token_counts([2, 3])[0].size == 0
    outer = store.range_of([1])
    assert store.range_of([1, 2], within=outer) == store.range_of([1, 2])


def test_backoff_drops_leading_tokens():
    store = TokenSuffixArray.from_documents([[7, 8, 9], [1, 8, 6]], vocab_size=10)
    ids, counts, used = store.next_tokens_backoff([3, 3, 7, 8], max_key=3)
    assert used == 2 and ids.tolist() == [9]
    ids, counts, used = store.next_tokens_backoff([4, 4, 8], max_key=3)
    assert used == 1 and sorted(ids.tolist()) == [6, 9]
    assert store.next_tokens_backoff([0], max_key=2)[2] == 0
