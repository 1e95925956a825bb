"""READER's self-repetition metric (section 4.1), worked by hand."""

from __future__ import annotations

import pytest

from benchmarks.repetition import advances, pooled, self_repetition


def brute_advances(prompt, response, docs=()):
    """Straight transcription of the paper's three steps (``docs``: the
    datastore's documents, further places a match may lie wholly inside)."""
    def occurs(needle, hay):
        n = len(needle)
        return any(hay[i:i + n] == needle for i in range(len(hay) - n + 1))

    p = steps = 0
    while p < len(response):
        length = 0
        for L in range(1, len(response) - p + 1):
            cand = response[p:p + L]
            if any(occurs(cand, h) for h in (prompt, response[:p], *docs)):
                length = L
            else:
                break
        p += length or 1
        steps += 1
    return steps


def test_no_repetition_is_one():
    assert self_repetition([], [1, 2, 3, 4]) == 1.0
    assert self_repetition([9, 8], [1, 2, 3, 4]) == 1.0


def test_copy_of_prompt():
    # The whole response is one substring of the prompt: one advance.
    assert advances([5, 1, 2, 3, 4, 6], [1, 2, 3, 4]) == 1
    assert self_repetition([5, 1, 2, 3, 4, 6], [1, 2, 3, 4]) == 4.0
    # Without the prompt nothing repeats.
    assert self_repetition([], [1, 2, 3, 4]) == 1.0


def test_self_repetition_uses_processed_prefix_only():
    # a b c a b c: pointer 0..2 advance by one each (nothing seen), then
    # "a b c" is found in the processed prefix: 4 advances for 6 tokens.
    r = [1, 2, 3, 1, 2, 3]
    assert advances([], r) == 4
    assert self_repetition([], r) == 1.5
    # a a a a: the match may not run past the pointer (no LZ77 overlap):
    # p=0 -> 1 (new), p=1 "a" -> 2, p=2 "a a" in "a a" -> 4: 3 advances.
    assert advances([], [7, 7, 7, 7]) == 3


def test_match_does_not_straddle_prompt_and_response():
    # "2 3" only exists across the prompt/response boundary.
    assert advances([1, 2], [3, 2, 3]) == 3


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
    response = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
    assert advances(prompt, response) == brute_advances(prompt, response)
    assert advances([], response) == brute_advances([], response)


def test_large_token_ids():
    big = [10**9, 10**9 + 1, 0x10FFFF + 5]
    assert self_repetition(big, big) == 3.0


def test_pooled_is_ratio_of_sums():
    out = pooled([([1, 2, 3], [1, 2, 3]), ([], [4, 5]), ([], [])])
    assert out["response_tokens"] == 5
    assert out["advances_with_prompt"] == 1 + 2
    assert out["with_prompt"] == 5 / 3
    assert out["advances_without_prompt"] == 3 + 2
    assert out["without_prompt"] == 1.0
    assert out["num_outputs"] == 2


SEP = 99  # the store's document separator (an id no response holds)


def joined(docs):
    out = []
    for d in docs:
        out += [*d, SEP]
    return out


def test_datastore_ceiling_by_hand():
    # "1 2 3 4" is one store document: one advance; the prompt alone has none.
    assert advances([], [1, 2, 3, 4], joined([[0, 1, 2, 3, 4]])) == 1
    # "2 3" exists only across two documents: no match spans the separator.
    assert advances([], [2, 3], joined([[1, 2], [3, 4]])) == 2
    out = pooled([([], [1, 2, 3, 4])], joined([[1, 2, 3, 4]]))
    assert out["with_datastore"] == 4.0 and out["with_prompt"] == 1.0
    assert "with_datastore" not in pooled([([], [1, 2])])


@pytest.mark.parametrize("seed", range(20))
def test_datastore_ceiling_matches_brute_force(seed):
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
    response = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 15))]
            for _ in range(rng.randrange(1, 4))]
    assert advances(prompt, response, joined(docs)) == brute_advances(prompt, response, docs)
