"""The method contract's pure parts."""

from vllm_specplug.engine.interface import draft_budget


def test_draft_budget_is_what_one_step_can_verify():
    assert draft_budget(8, 0, 100, 10, True) == 8
    assert draft_budget(8, 3, 100, 10, True) == 3  # the scheduler's cap
    assert draft_budget(8, 0, 100, 95, True) == 4  # 4 drafts + the bonus token
    assert draft_budget(8, 0, 100, 99, True) == 0
    assert draft_budget(8, 0, 100, 10, False) == 0  # a prompt chunk: no draft
