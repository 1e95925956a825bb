"""Copy-path scores (sources/copy_path.py) and the suffix match they rest
on (sources/ngram.py), on hand-made numbers."""

import numpy as np
import pytest

from vllm_specplug.sources.copy_path import CopyConfidence, Rate, accepted_prefix
from vllm_specplug.sources.ngram import continuations, match


def test_rate_prior_then_data():
    r = Rate(0.5, weight=4)
    assert r.value == 0.5
    r.add(6, 6)  # (6 + 2) / (6 + 4)
    assert r.value == pytest.approx(0.8)


def test_copy_scores_follow_match_length_and_depth():
    c = CopyConfidence(4)
    s1, s4 = c.scores(1, 3), c.scores(7, 3)  # 7 counts as 4+
    assert s4[0] > s1[0] and all(a > b for a, b in zip(s4, s4[1:]))
    assert s4[1] == pytest.approx(s4[0] * c.next[3].value)
    assert c.scores(2, 2, scale=0.5)[0] == pytest.approx(0.5 * c.first[1].value)


def test_copy_record_counts_trials_given_the_parent():
    c = CopyConfidence(2)
    c.record(2, verified=5, accepted=3)  # first ok; tokens 2,3 ok, token 4 failed
    assert (c.first[1].successes, c.first[1].trials) == (1, 1)
    assert (c.next[1].successes, c.next[1].trials) == (2, 3)
    c.record(2, verified=3, accepted=3)  # all accepted: token 3 was the last tried
    assert (c.next[1].successes, c.next[1].trials) == (4, 5)
    c.record(1, verified=4, accepted=0)
    assert (c.first[0].successes, c.first[0].trials, c.next[0].trials) == (0, 1, 0)
    c.record(1, verified=0, accepted=0)  # nothing verified: nothing learned
    assert c.first[0].trials == 1


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 6]) == 2
    assert accepted_prefix([4], []) == 0


def test_match_gives_length_and_anchor():
    toks = np.array([7, 8, 1, 2, 3, 9, 1, 4, 8, 1])
    n, begins = match(toks, 1, 4, 3)
    assert n == 2 and begins == [3]  # "8 1" at 1..2: earliest, continues at 3
    assert continuations(toks, 1, 4, 2, 3)[0].tolist() == [2, 3]
    assert match(np.array([1, 2, 3]), 1, 4) == (0, [])
