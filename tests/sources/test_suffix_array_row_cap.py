"""The suffix array's row cap: a very common key reads a bounded number of
rows, and the counts it returns agree with a brute-force count."""

from __future__ import annotations


import numpy as np
import pytest

from tests.helpers.next_tokens import brute_next_tokens
from vllm_specplug.sources.suffix_array import TokenSuffixArray




class _CountingStore(TokenSuffixArray):
    """Counts the suffix-array rows a query reads."""

    rows_read = 0

    def _next_tokens(self, rows, n):
        self.rows_read += int(np.size(rows))
        return super()._next_tokens(rows, n)


def _store(docs, vocab):
    base = TokenSuffixArray.from_documents(docs, vocab)
    return _CountingStore(base.tokens, base.sa, base.separator)


def test_a_key_with_many_hits_reads_a_bounded_number_of_rows():
    rng = np.random.default_rng(0)
    # 200,000 tokens, token 7 every other one: the key [7] has 100,000 hits
    doc = np.empty(200_000, dtype=np.int64)
    doc[0::2] = 7
    doc[1::2] = rng.choice([1, 2, 3, 4, 5], size=100_000, p=[0.5, 0.3, 0.1, 0.07, 0.03])
    docs = [doc.tolist()]
    store = _store(docs, vocab=10)
    ids, counts = store.next_token_counts([7], max_rows=256)
    # 256 samples, then two binary searches of ~log2(100000/256) steps per run end
    assert store.rows_read <= 256 + 2 * 4 * 10
    want = brute_next_tokens(docs, [7])
    assert dict(zip(ids.tolist(), counts.tolist())) == dict(want)  # every run >= stride
    assert ids.tolist() == [1, 2, 3, 4, 5]
    store.rows_read = 0
    store.next_token_counts([7])  # uncapped: every row of the range
    assert store.rows_read == 100_000


@pytest.mark.parametrize("seed", range(8))
def test_capped_counts_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([6, 70000]))
    docs = [rng.choice(6, size=int(rng.integers(0, 400)),
                       p=[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]).tolist()
            for _ in range(int(rng.integers(1, 6)))]
    store = TokenSuffixArray.from_documents(docs, vocab)
    for _ in range(30):
        key = rng.integers(0, 6, int(rng.integers(1, 3))).tolist()
        cap = int(rng.integers(2, 40))
        want = brute_next_tokens(docs, key)
        got = dict(zip(*(a.tolist() for a in store.next_token_counts(key, max_rows=cap))))
        rows = sum(want.values()) + sum(1 for d in docs for i in range(len(d) - len(key) + 1)
                                        if d[i : i + len(key)] == key and i + len(key) == len(d))
        if rows <= cap:
            assert got == dict(want)  # under the cap: the exact counts
            continue
        stride = -(-rows // (cap - 1))  # samples are at most this far apart
        for tok, n in want.items():  # a frequent continuation is always found, exactly
            if n >= stride:
                assert got.get(tok) == n
        for tok, n in got.items():  # nothing invented, no count off
            assert want[tok] == n


def test_backoff_passes_the_cap_on():
    docs = [[1, 2] * 500]
    store = _store(docs, vocab=5)
    ids, counts, used = store.next_tokens_backoff([9, 1], max_key=2, max_rows=16)
    assert used == 1 and ids.tolist() == [2] and counts.tolist() == [500]
    assert store.rows_read < 16 + 2 * 10
