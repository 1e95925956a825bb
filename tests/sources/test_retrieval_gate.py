"""ReSpec's trigger and EMA selection on hand-made entropies and outcomes."""

from __future__ import annotations

import pytest

from vllm_specplug.sources.retrieval_gate import PositionScores, choose_key


def test_trigger_picks_argmin_of_entropy_plus_length_penalty():
    # entropies oldest first; the last belongs to the newest token
    ent = [3.0, 0.4, 0.2]
    # H1 = 0.2, C1 = 0.2 + 1.0 = 1.2; H2 = 0.3, C2 = 0.8; H3 = 1.2, C3 = 1.533
    c = choose_key(ent, max_len=3, lambda_e=1.0, theta=1.5)
    assert (c.length, c.entropy, c.fire) == (2, pytest.approx(0.3), True)
    # no length penalty: the single lowest-entropy key wins
    c = choose_key(ent, max_len=3, lambda_e=0.0, theta=1.5)
    assert (c.length, c.entropy) == (1, pytest.approx(0.2))
    # a big penalty prefers the longest key, whose entropy is then too high
    c = choose_key(ent, max_len=3, lambda_e=10.0, theta=1.0)
    assert (c.length, c.entropy, c.fire) == (3, pytest.approx(1.2), False)


def test_trigger_without_entropies_never_fires():
    c = choose_key([], max_len=3, lambda_e=1.0, theta=1.5)
    assert c.length == 0 and not c.fire
    assert choose_key([0.1], max_len=3, lambda_e=1.0, theta=1.5).length == 1


def test_ema_feedback_and_selection():
    s = PositionScores(alpha=0.5, init=0.5)
    # new positions all start at 0.5; ties go to the most recent
    assert s.select([3, 10, 7, 1], theta=0.2, top=3) == [10, 7, 3]
    s.feedback([10, 7, 3], winner=7, accepted=3, drafted=4)
    # 7: 0.5*0.5 + 0.5*0.75 = 0.625; 10 and 3: 0.25
    assert s.scores == {10: 0.25, 7: 0.625, 3: 0.25}
    assert s.select([3, 10, 7, 1], theta=0.3, top=3) == [7, 1]  # 3, 10 filtered
    s.feedback([7, 1], winner=None, accepted=0, drafted=4)
    assert s.scores[7] == pytest.approx(0.3125) and s.scores[1] == pytest.approx(0.25)
