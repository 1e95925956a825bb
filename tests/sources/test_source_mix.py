"""SourceMix: judging a tree against what the target produced, learning a
factor per source from it, and merging trees by calibrated chance. Expected
values are worked by hand from the trees written here."""

from __future__ import annotations

import pytest

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.source_mix import Judged, SourceMix, judge


def test_judge_marks_nodes_under_a_right_parent_only():
    # root -> 5 -> 6 -> 7 ; root -> 9 -> 10
    tree = DraftTree([5, 6, 7, 9, 10], [-1, 0, 1, -1, 3])
    # the target produced 5, 6 (two tokens known): 7 lies past them, 10 below a wrong node
    assert judge(tree, [5, 6]) == [True, True, None, False, None]
    assert judge(tree, [5, 8, 1]) == [True, False, None, False, None]
    assert judge(tree, []) == [None, None, None, None, None]


def test_merge_keeps_the_likeliest_nodes_rooted_and_best_path_first():
    mix = SourceMix()
    copy = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.9, 0.8, 0.7])
    head = DraftTree([1, 4, 5], [-1, 0, -1], scores=[0.6, 0.5, 0.3])
    tree = mix.merge("r", [("copy", copy), ("head", head)], budget=4, history_len=10)
    # union: 1 (0.9, copy's; the head drafted it too) {2 (0.8) {3 (0.7)},
    # 4: the head's 0.5 / 0.6 given 1, times 1's 0.9 = 0.75}, 5 (0.3):
    # the four best are 1, 2, 4, 3
    assert tree.tokens == [1, 2, 3, 4]
    assert tree.parents == [-1, 0, 1, 0]
    assert tree.sources == ["copy", "copy", "copy", "head"]
    assert tree.scores == pytest.approx([0.9, 0.8, 0.7, 0.75])


def test_merge_after_expected_starts_from_its_pool():
    # the same trees as above: expected() pools the copy's tree, merge adds
    # the head's to that pool; the tree is the one worked by hand above
    mix = SourceMix()
    copy = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.9, 0.8, 0.7])
    head = DraftTree([1, 4, 5], [-1, 0, -1], scores=[0.6, 0.5, 0.3])
    assert mix.expected("r", [("copy", copy)], budget=2) == pytest.approx(0.9 + 0.8)
    tree = mix.merge("r", [("copy", copy), ("head", head)], budget=4, history_len=10)
    assert tree.tokens == [1, 2, 3, 4] and tree.parents == [-1, 0, 1, 0]
    assert tree.sources == ["copy", "copy", "copy", "head"]
    assert tree.scores == pytest.approx([0.9, 0.8, 0.7, 0.75])
    assert "r" not in mix._pooled  # used once
    # drafts that do not begin with the pooled trees are pooled afresh
    mix.expected("s", [("copy", copy)], budget=2)
    other = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.9, 0.8, 0.7])
    tree = mix.merge("s", [("head", head), ("copy", other)], budget=4, history_len=10)
    assert tree.tokens == [1, 2, 3, 4] and tree.sources == ["head", "copy", "copy", "head"]
    mix.expected("t", [("copy", copy)], budget=2)
    mix.remove_request("t")
    assert "t" not in mix._pooled


def test_a_shared_node_takes_the_cheaper_sources_name_and_the_higher_chance():
    mix = SourceMix()
    cheap = DraftTree([7], [-1], scores=[0.2])
    costly = DraftTree([7, 8], [-1, 0], scores=[0.6, 0.4])
    tree = mix.merge("r", [("cheap", cheap), ("costly", costly)], budget=8, history_len=0)
    assert tree.tokens == [7, 8] and tree.sources == ["cheap", "costly"]
    assert tree.scores == pytest.approx([0.6, 0.4])


def test_deeper_shared_nodes_take_the_higher_chance():
    mix = SourceMix()
    # both draft 1 -> 2 -> 3; b is surer of 2 and 3; c offers 1 -> 9 at 0.42
    a = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.9, 0.3, 0.2])
    b = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.9, 0.5, 0.45])
    c = DraftTree([1, 9], [-1, 0], scores=[0.9, 0.42])
    tree = mix.merge("r", [("a", a), ("b", b), ("c", c)], budget=3, history_len=0)
    # 1 (0.9), 2 (0.5), 3 (0.45) beat 9 (0.42): all named after a, the first to draft them
    assert tree.tokens == [1, 2, 3] and tree.sources == ["a", "a", "a"]
    assert tree.scores == pytest.approx([0.9, 0.5, 0.45])


def test_a_chain_is_the_path_with_the_most_expected_tokens():
    mix = SourceMix()
    # a wide tree: 5 (0.6) then nothing; 1 (0.5) -> 2 (0.45) -> 3 (0.4)
    tree = DraftTree([5, 1, 2, 3], [-1, -1, 1, 2], scores=[0.6, 0.5, 0.45, 0.4])
    chain = mix.merge("r", [("s", tree)], budget=3, history_len=0, chain=True)
    assert chain.tokens == [1, 2, 3] and chain.parents == [-1, 0, 1]
    # a budget of 1 keeps the single likeliest node
    assert mix.merge("r", [("s", tree)], budget=1, history_len=0, chain=True).tokens == [5]


def test_factors_learn_per_source_and_per_request():
    mix = SourceMix(request_weight=4.0, source_weight=8.0, half_life=1e9,
                    request_half_life=1e9)
    for step in range(20):
        a = DraftTree([1], [-1], scores=[0.5])
        b = DraftTree([2], [-1], scores=[0.5])
        mix.merge("r", [("a", a), ("b", b)], budget=2, history_len=step)
        # the target produced 1: source a was right every time, b never
        got = mix.observe("r", list(range(step)) + [1])
        assert got == {"a": Judged(0.5, 1, 1), "b": Judged(0.5, 0, 0)}
    # a: realised 20 against claims of 10, shrunk toward 1 by 8 claims' weight
    base_a = (20 + 8) / (10 + 8)
    assert mix.factor("other", "a") == pytest.approx(base_a)
    assert mix.factor("r", "a") == pytest.approx((20 + base_a * 4) / (10 + 4))
    assert mix.factor("r", "b") == pytest.approx((0 + 8 / 18 * 4) / (10 + 4))
    # calibrated: a's claim 0.5 doubles (capped at 1), b's falls
    tree = mix.merge("r", [("b", DraftTree([2], [-1], scores=[0.5])),
                           ("a", DraftTree([1], [-1], scores=[0.5]))], budget=1,
                     history_len=0)
    assert tree.tokens == [1]


def test_observe_uses_the_sources_own_claims_not_the_calibrated_ones():
    mix = SourceMix(half_life=1e9)
    mix.sources.clear()
    for step in range(5):
        mix.merge("r", [("a", DraftTree([1], [-1], scores=[0.4]))], budget=1,
                  history_len=step)
        assert mix.observe("r", [0] * step + [1]) == {"a": Judged(0.4, 1, 1)}


def test_each_source_is_judged_on_its_own_tree_and_credited_for_what_it_added():
    mix = SourceMix()
    # both draft 1 -> 2; the head adds 3 under 2; the budget keeps 2 nodes
    copy = DraftTree([1, 2], [-1, 0], scores=[0.8, 0.4])
    head = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.5, 0.25, 0.2])
    tree = mix.merge("r", [("copy", copy), ("head", head)], budget=2, history_len=0)
    assert tree.tokens == [1, 2] and tree.sources == ["copy", "copy"]
    got = mix.observe("r", [1, 2, 3])
    # each tree judged whole, on its own chances given the parent: copy
    # 0.8 + 0.5; head 0.5 + 0.5 + 0.8 (3, cut by the budget, still judged)
    assert got["copy"] == Judged(pytest.approx(1.3), 2, 2)
    assert got["head"] == Judged(pytest.approx(1.8), 3, 0)


def test_a_requests_evidence_fades_so_it_follows_a_change_of_kind():
    mix = SourceMix(request_weight=1.0, source_weight=1e9, request_half_life=4)
    for step in range(40):  # source a right for 20 steps, then never
        mix.merge("r", [("a", DraftTree([1], [-1], scores=[0.5]))], budget=1,
                  history_len=step)
        mix.observe("r", [0] * step + [1 if step < 20 else 2])
    # each step's evidence weighs d = 2^(-1/4) per later step: realised
    # sum(d^20..d^39), claimed 0.5 * sum(d^0..d^39), shrunk by weight 1 to 1
    d = 0.5 ** 0.25
    realised = sum(d ** k for k in range(20, 40))
    claimed = 0.5 * sum(d ** k for k in range(40))
    assert mix.factor("r", "a") == pytest.approx((realised + 1) / (claimed + 1))
    assert mix.factor("r", "a") < 0.3  # without fading: (20 + 1) / (20 + 1) = 1
    assert mix.factor("other", "a") == pytest.approx(1.0, abs=1e-6)
