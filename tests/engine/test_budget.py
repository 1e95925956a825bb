"""The cost-aware budget controller, on hand-made trees, costs and truths.

Expected values are worked out by hand or by brute force over every
rooted subset (every kept node's parent kept), never by the controller's own code path.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_specplug.engine.budget.controller import GATE_LOG, GATE_LOG_FIELDS, PLAIN_TRIES
from vllm_specplug.engine.budget import (
    AcceptanceModel,
    BudgetController,
    DraftGate,
    FixedBudget,
    StepCost,
    make_budget,
    shadow_outcomes,
    subtree,
)
from vllm_specplug.engine.tree import DraftTree

#        root
#       /    \
#     5(0)   7(1)
#     /  \      \
#   6(2) 9(3)   8(4)
#    |
#   4(5)
TREE = DraftTree([5, 7, 6, 9, 8, 4], [-1, -1, 0, 0, 1, 2])


def measure(cost: StepCost, rows: int, seconds: float) -> None:
    """Two steps of ``rows`` at ``seconds``: a knot is on the curve from
    its second step."""
    cost.observe(rows, seconds)
    cost.observe(rows, seconds)


def test_shadow_outcomes_follow_the_truth():
    out, done = shadow_outcomes(TREE, [5, 6, 4, 1])
    # depth 1: 5 ok (rank 0), 7 no (rank 1); depth 2 under 5: 6 ok, 9 no;
    # depth 3 under 6: 4 ok; 4 is a leaf: complete
    assert out == [(1, 0, True), (1, 1, False), (2, 0, True), (2, 1, False), (3, 0, True)]
    assert done


def test_shadow_outcomes_wait_for_unknown_tokens():
    out, done = shadow_outcomes(TREE, [5])
    assert out == [(1, 0, True), (1, 1, False)]
    assert not done
    out, done = shadow_outcomes(TREE, [7, 3])
    assert out == [(1, 0, False), (1, 1, True), (2, 0, False)]
    assert done
    out, done = shadow_outcomes(TREE, [])
    assert out == [] and not done


def test_sibling_rank_uses_scores_when_present():
    t = DraftTree([5, 7], [-1, -1], scores=[-2.0, -0.5])
    out, _ = shadow_outcomes(t, [5])
    assert out == [(1, 1, True), (1, 0, False)]


def test_subtree_keeps_metadata_and_order():
    t = DraftTree(TREE.tokens, TREE.parents, scores=[0, 1, 2, 3, 4, 5],
                  sources=list("abcdef"))
    keep = np.array([True, False, True, False, False, True])
    s = subtree(t, keep)
    assert s.tokens == [5, 6, 4] and s.parents == [-1, 0, 1]
    assert s.scores == [0, 2, 5] and s.sources == ["a", "c", "f"]


def test_step_cost_interpolates_and_extrapolates_optimistically():
    c = StepCost()
    assert not c.known and c(8) == 0.0
    measure(c, 4, 0.040)
    measure(c, 16, 0.100)
    assert c(4) == pytest.approx(0.040)
    assert c(16) == pytest.approx(0.100)
    assert c(10) == pytest.approx(0.070)  # halfway between 4 and 16
    # above the largest seen: along the average slope (5 ms a row)
    assert c(64) == pytest.approx(0.100 + 48 * 0.005)
    assert c(2) == pytest.approx(0.020)  # proportional below the smallest seen
    c.observe(4, 0.060)  # then EMA, alpha 0.2
    assert c(4) == pytest.approx(0.044)


def test_a_knot_enters_the_curve_from_its_second_step_at_the_cheaper():
    c = StepCost()
    c.observe(1, 0.025)
    assert not c.known and c.as_dict() == {}
    c.observe(1, 0.030)
    assert c.known and c(1) == pytest.approx(0.025)
    # a 16-row step stalled (500 ms): left out, the curve stays flat there
    c.observe(16, 0.500)
    assert c(16) == pytest.approx(0.025)
    c.observe(16, 0.045)  # the second: the cheaper of the two
    assert c(16) == pytest.approx(0.045)
    # later a stall counts at most twice the knot's value
    c.observe(16, 0.500)
    assert c(16) == pytest.approx(0.045 + 0.2 * (0.090 - 0.045))


def test_one_stalled_step_does_not_close_the_gate():
    # batch 1, a chain of 4 nodes each 0.8 likely given its parent; 25 ms
    # plain steps, 5-row steps at 30 ms. The first 5-row step stalls at
    # 400 ms: believed, it would make a row cost 94 ms, no cut would pay
    # and the gate would close until the knot went stale
    model = AcceptanceModel(max_depth=4, max_rank=1, prior_weight=1e-9)
    model.engine.seen[:, 0], model.engine.acc[:, 0] = 1e6, 0.8e6
    ctl = BudgetController(model)
    measure(ctl.cost, 1, 0.025)
    chain = DraftTree([5, 6, 7, 8], [-1, 0, 1, 2])
    for step in range(40):
        assert ctl.draft_now()
        _, choice = ctl.choose(["a"], [chain], [3], rows=1)
        assert choice.sizes == [4]
        ctl.observe_step(5, 0.400 if step == 0 else 0.030)
    assert ctl.cost(5) == pytest.approx(0.030)


def test_step_cost_forgets_a_knot_it_has_not_seen_for_long():
    # an 8-row step measured at 73 ms (one-time costs) while 1-row steps
    # cost 28 ms: after `stale_after` steps without an 8-row step the knot
    # leaves the curve (optimistic there: flat at the largest fresh knot),
    # and starts over: on the curve from the second 8-row step after that
    c = StepCost(stale_after=10)
    for _ in range(3):
        c.observe(8, 0.073)
    measure(c, 1, 0.028)
    assert c(8) == pytest.approx(0.073)
    for _ in range(10):
        c.observe(1, 0.028)
    assert c(8) == pytest.approx(0.028)
    assert set(c.as_dict()) == {"1"}
    c.observe(8, 0.031)
    assert c(8) == pytest.approx(0.028)
    c.observe(8, 0.032)
    assert c(8) == pytest.approx(0.031)


def test_step_cost_never_falls_as_rows_grow():
    # a batch-8 curve whose few small-row knots (a burst's tail, where
    # few requests still decode) are one-offs. A knot dearer
    # than a larger one leaves the curve: plain decoding at 8 rows is read
    # proportionally below the 10-row knot (58 ms), not the 609 ms
    # interpolated between 6 and 10 rows.
    c = StepCost()
    for rows, ms in [(1, 119.065), (2, 401.704), (3, 428.603), (6, 1159.973),
                     (10, 57.986), (32, 137.728), (128, 346.491)]:
        c.observe(rows, ms / 1e3)
        c.observe(rows, ms / 1e3)  # the second step replaces the first: same
    assert c(10) == pytest.approx(0.057986)
    assert c(8) == pytest.approx(0.057986 * 8 / 10)
    assert c(6) == pytest.approx(0.057986 * 6 / 10)
    assert c(1) == pytest.approx(0.057986 / 10)
    assert c(32) == pytest.approx(0.137728)  # consistent knots are untouched
    assert c(80) == pytest.approx(0.137728 + (0.346491 - 0.137728) * 48 / 96)
    assert c.as_dict()["6"] == pytest.approx(1159.973)  # stats show what was measured
    # a larger knot measured lower takes a smaller one more than 1.25x
    # dearer out at once, and the smaller one comes back once it is
    # consistent again
    for _ in range(7):
        c.observe(128, 0.010)  # EMA, alpha 0.2: 0.346491 * 0.8**7 + 0.010 * (1 - 0.8**7)
    low = 0.346491 * 0.8 ** 7 + 0.010 * (1 - 0.8 ** 7)  # 0.0806: 32 rows' 0.1377 is 1.7x
    assert c(128) == pytest.approx(low)
    assert c(32) == pytest.approx(0.057986 + (low - 0.057986) * 22 / 118)
    assert c(10) == pytest.approx(0.057986)
    for _ in range(30):
        c.observe(128, 0.400)
    assert c(32) == pytest.approx(0.137728)


def test_knots_within_noise_of_each_other_are_pooled_not_dropped():
    # batch 1 on a CPU: 1 to 6 rows cost the same within 4 %, a 16-row
    # step 87.5 ms (a pld engine's knots on Spec-Bench QA). The 6-row knot
    # read cheapest; leaving every dearer smaller knot out read plain
    # decoding as 51.6 / 6 = 8.6 ms, and no draft was ever kept. Pooled,
    # 1 to 6 rows read their mean, 52.62 ms
    c = StepCost()
    for rows, ms in [(1, 53.652), (3, 52.555), (5, 52.690), (6, 51.615), (16, 87.540)]:
        measure(c, rows, ms / 1e3)
    mean = (53.652 + 52.555 + 52.690 + 51.615) / 4 / 1e3
    for rows in (1, 2, 3, 5, 6):
        assert c(rows) == pytest.approx(mean)
    assert c(16) == pytest.approx(0.08754)
    assert c(11) == pytest.approx(mean + (0.08754 - mean) * 5 / 10)
    # a one-token copy accepted 15 % of the time now pays a row: (1 + 0.15)
    # tokens in 52.6 ms beat 1 token in 52.6 ms
    model = AcceptanceModel(max_depth=1, max_rank=1, prior_weight=1e-9)
    model.engine.seen[0, 0], model.engine.acc[0, 0] = 1e6, 0.15e6
    ctl = BudgetController(model, c)
    _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert choice.sizes == [1]
    # a knot more than 1.25x dearer than a larger one is still a one-off
    c = StepCost()
    for rows, ms in [(1, 53.652), (3, 70.0), (6, 51.615)]:
        measure(c, rows, ms / 1e3)
    assert c(3) == pytest.approx((53.652 + 51.615) / 2 / 1e3)


def test_a_dear_plain_knot_does_not_make_drafting_look_free():
    # batch 8: the 8-row knot (plain decoding) measured at 385 ms in a
    # warm-up that shared the CPU with another engine, while the drafted
    # 23-row steps cost 234 ms. Clamped to the 23-row value, plain decoding
    # would cost what 15 draft rows do, so any draft would look free. Left
    # out, plain is read proportionally: 234 * 8/23.
    c = StepCost()
    for rows, ms in [(5, 299.5), (6, 312.5), (8, 385.1), (32, 726.0), (23, 234.5)]:
        c.observe(rows, ms / 1e3)
        c.observe(rows, ms / 1e3)
    assert c(8) == pytest.approx(0.2345 * 8 / 23)
    assert c(23) == pytest.approx(0.2345)
    ctl = BudgetController(AcceptanceModel(max_depth=1, max_rank=1, prior_weight=1e-9), c)
    ctl.acceptance.engine.seen[0, 0], ctl.acceptance.engine.acc[0, 0] = 1e6, 0.3e6
    trees = [DraftTree([5], [-1]) for _ in range(8)]
    _, choice = ctl.choose([str(i) for i in range(8)], trees, [3] * 8, rows=8)
    # a 0.3-likely node costs ~10 ms a row here against ~10 ms per plain
    # row's token: not worth a row
    assert choice.sizes == [0] * 8


def _rooted_subsets(tree: DraftTree):
    n = len(tree)
    for bits in itertools.product([False, True], repeat=n):
        if all(not b or p < 0 or bits[p] for b, p in zip(bits, tree.parents)):
            yield np.array(bits)


def _path_probs(tree: DraftTree, cond: dict[tuple[int, int], float]) -> np.ndarray:
    # unconditional acceptance by hand: product of per-(depth, rank) rates
    depths = tree.depths()
    ranks = {}
    for kids in tree.children():
        for r, c in enumerate(kids):
            ranks[c] = r
    out = np.zeros(len(tree))
    for i, p in enumerate(tree.parents):
        out[i] = cond[(int(depths[i]), min(ranks[i], 1))] * (1 if p < 0 else out[p])
    return out


@pytest.mark.parametrize("slope", [0.0, 0.002, 0.01, 0.05])
def test_choice_is_the_brute_force_optimum(slope):
    # a hand-set acceptance model: depth 1 rank 0 accepted 80% of the time,
    # deeper rank-0 nodes 60%, other ranks 10% (no prior: lots of evidence)
    cond = {(d, r): (0.8 if d == 1 else 0.6) if r == 0 else 0.1
            for d in range(1, 9) for r in range(2)}
    model = AcceptanceModel(max_depth=8, max_rank=2, prior_weight=1e-9)
    for (d, r), p in cond.items():
        model.engine.seen[d - 1, r] = 1e6
        model.engine.acc[d - 1, r] = p * 1e6
    cost = StepCost()
    for rows in range(1, 40):  # T(R) = 50 ms + slope * (R - 1)
        measure(cost, rows, 0.050 + slope * (rows - 1))
    ctl = BudgetController(model, cost)
    other = DraftTree([1, 2, 3, 4], [-1, 0, 1, -1])
    trees = [TREE, other]
    cut, choice = ctl.choose(["a", "b"], trees, [10, 10], rows=2)

    probs = [_path_probs(t, cond) for t in trees]
    best = 2 / cost(2)
    for ka in _rooted_subsets(TREE):
        for kb in _rooted_subsets(other):
            n = int(ka.sum() + kb.sum())
            rate = (2 + probs[0][ka].sum() + probs[1][kb].sum()) / cost(2 + n)
            best = max(best, rate)
    assert choice.expected_rate == pytest.approx(best)
    assert choice.expected_rate >= choice.plain_rate
    if slope == 0.0:
        assert choice.sizes == [6, 4]  # free rows: verify everything
    if slope == 0.05:
        assert choice.sizes == [0, 0]  # a row costs as much as a plain step
        assert cut == [None, None]


def test_unknown_cost_verifies_everything():
    ctl = BudgetController()
    cut, choice = ctl.choose(["a"], [TREE], [3], rows=1)
    assert choice.sizes == [len(TREE)] and cut[0].tokens == TREE.tokens


def test_learning_from_shadow_outcomes():
    # every first child is right, every other child wrong: the estimates of
    # rank 0 go to ~1 and of rank 1 to ~0, per request and engine-wide
    ctl = BudgetController(AcceptanceModel(max_depth=4, max_rank=2))
    history = list(range(100, 110))
    tree = DraftTree([50, 60, 51, 61], [-1, -1, 0, 0])  # truth is 50, 51
    for step in range(40):
        ctl.choose(["r"], [tree], [len(history)], rows=1)
        history += [50, 51, 7]
        ctl.learn("r", np.asarray(history))
    rates = ctl.acceptance.rates("r")
    assert rates[0, 0] > 0.95 and rates[1, 0] > 0.95
    assert rates[0, 1] < 0.05 and rates[1, 1] < 0.05
    assert not ctl._pending["r"]  # all resolved
    ctl.forget("r")
    assert "r" not in ctl.acceptance.requests


def test_a_step_without_decoding_requests_keeps_its_trees():
    # prompt chunks only (rows=0): nothing to weigh, nothing may break
    cost = StepCost()
    measure(cost, 1, 0.05)
    ctl = BudgetController(cost=cost)
    cut, choice = ctl.choose(["a", "b"], [None, None], [5, 7], rows=0)
    assert cut == [None, None] and choice.sizes == [0, 0]
    assert cost(0) > 0


def _cold_controller(p: float, gate: DraftGate) -> BudgetController:
    """One request, flat step cost (100 ms at 1 or 2 rows), a one-node tree
    accepted with probability ``p`` (lots of evidence), ``gate`` (cold), no
    drafting measured yet."""
    model = AcceptanceModel(max_depth=1, max_rank=1, prior_weight=1e-9)
    model.engine.seen[0, 0], model.engine.acc[0, 0] = 1e6, p * 1e6
    cost = StepCost()
    measure(cost, 1, 0.100)
    measure(cost, 2, 0.100)
    return BudgetController(model, cost, gate=gate)


def _one_node_controller(p: float, draft_ms: float) -> BudgetController:
    """One request, flat step cost (100 ms at 1 or 2 rows), a one-node tree
    accepted with probability ``p`` (lots of evidence), drafting that adds
    ``draft_ms`` to the proposer's time; its gate past its probation."""
    ctl = _cold_controller(p, DraftGate(probation=0))
    ctl.observe_propose(0.001 + draft_ms / 1e3, drafted=True)
    ctl.observe_propose(0.001, drafted=False)
    return ctl


def test_gate_closes_when_drafting_does_not_pay_for_itself():
    # plain: 1 token / 100 ms. The node is worth verifying once drafted
    # (1.05 tokens / 100 ms) but not worth drafting at 50 ms:
    # 1.05 / 150 ms < 1 / 100 ms.
    ctl = _one_node_controller(0.05, 50.0)
    assert ctl.gate.draft_seconds == pytest.approx(0.050)
    assert ctl.draft_now()
    _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert choice.sizes == [1]  # drafting is sunk: the node is verified
    # closed: skip 2 steps, explore once, then (still not paying) 4, ...
    seen = [ctl.draft_now() for _ in range(3)]
    assert seen == [False, False, True]
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    seen = [ctl.draft_now() for _ in range(5)]
    assert seen == [False] * 4 + [True]
    assert ctl.stats.gated_steps == 6


def test_will_draft_tells_what_draft_now_answers():
    # the runner reads will_draft in sampling, before draft_now: it must
    # say the same and change nothing (a closed gate's skips and explores)
    ctl = _one_node_controller(0.05, 50.0)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)  # closes
    seen = []
    for _ in range(3):
        for _ in range(5):
            peek, peek2 = ctl.will_draft, ctl.will_draft
            assert peek == peek2 == ctl.draft_now()
            seen.append(peek)
        ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert False in seen and True in seen


def test_gate_stays_open_when_drafting_pays_and_reopens():
    # 1.9 tokens / 150 ms > 1 / 100 ms: drafting pays even at 50 ms
    ctl = _one_node_controller(0.9, 50.0)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert all(ctl.draft_now() for _ in range(10))
    # the same controller after a bad spell: closed, then an exploring
    # step whose tree pays opens it again
    ctl.gate.judge(False)
    ctl.gate.judge(False)
    assert [ctl.draft_now() for _ in range(5)] == [False] * 4 + [True]
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert all(ctl.draft_now() for _ in range(10))
    # at batch 1 the exploring step was the batch's drafting: it paid, so
    # the back-off starts again at 2
    ctl.gate.judge(False)
    assert [ctl.draft_now() for _ in range(3)] == [False, False, True]


def test_gate_without_drafting_cost_never_closes():
    # free drafting: a step whose best cut is empty loses nothing, so the
    # gate stays open (closing on it would skip the next 2-32 steps'
    # drafts, good ones included)
    ctl = _one_node_controller(0.05, 0.0)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert ctl.draft_now()
    for _ in range(8):  # now a row costs nearly a plain step: nothing pays
        ctl.cost.observe(2, 0.200)
    for _ in range(20):
        _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
        assert choice.sizes == [0]
        assert ctl.draft_now()


def test_gate_closes_on_the_average_of_drafted_steps():
    # 1 ms of drafting a step. The first step's node pays: 1.5 tokens (100
    # ms of plain decoding each) in a 100 ms step, +49 ms. Then a row costs
    # a plain step and every cut is empty: -1 ms a step. The average
    # (alpha 0.2) turns negative after 18 such steps, not after the first;
    # a closed gate's exploring step that pays opens it again.
    ctl = _one_node_controller(0.5, 1.0)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert ctl.draft_now()
    assert ctl.gate.surplus == pytest.approx(1.5 * 0.100 - 0.100 - 0.001)
    for _ in range(8):
        ctl.cost.observe(2, 0.200)
    for step in range(1, 40):
        _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
        assert choice.sizes == [0]
        if not ctl.draft_now():
            break
    assert step == 18
    for _ in range(8):
        ctl.cost.observe(2, 0.100)
    while not ctl.draft_now():  # skipped steps, then one exploring step
        pass
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    # judged alone (the step-cost curve's 2-row knot is still coming down)
    assert ctl.gate.open
    assert ctl.gate.surplus == pytest.approx(1.5 * ctl.cost(1) - ctl.cost(2) - 0.001)


def _draft_step(ctl: BudgetController, propose_s: float) -> None:
    """One step the gate let draft: the proposer's time, then the verdict
    on a one-node tree."""
    ctl.observe_propose(propose_s, drafted=True)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)


def test_a_cold_gate_explores_every_step_on_probation():
    # Flat 100 ms steps, a node worth 0.2 tokens (20 ms). The first drafted
    # step also feeds a head the prompt (drafting 40 ms), the next ones
    # cost 5 ms. Verdicts by hand: 20 - 40 = -20 ms (closed); the estimate
    # moves half way to 5 ms at once (22.5 ms): -2.5 ms (closed); 13.75
    # ms: +6.25 ms (open). On probation the closed gate explores the very
    # next step each time: open after 3 steps, no step undrafted.
    ctl = _cold_controller(0.2, DraftGate())
    seen = []
    for propose_s in [0.040, 0.005, 0.005]:
        seen.append(ctl.draft_now())
        _draft_step(ctl, propose_s)
    assert seen == [True] * 3
    assert ctl.gate.open and ctl.gate.verdicts == 3
    assert ctl.gate.surplus == pytest.approx(0.020 - 0.01375)
    # past probation (here from the start) the same engine backs off, and
    # a cheaper step moves the estimate a fifth of the way: 40 ms, then
    # 33, 27.4, 22.92 (closed, after 2, 4, 14 and 16 undrafted steps: from
    # the third closing exploring takes at most 2 % of the time, and an
    # exploring step is priced at 27.4 ms against 100 ms steps) and
    # 19.34 ms (+0.66 ms: open)
    late = _cold_controller(0.2, DraftGate(probation=0))
    late.draft_now()
    _draft_step(late, 0.040)
    undrafted = 0
    while not late.gate.open:
        if late.draft_now():
            _draft_step(late, 0.005)
        else:
            late.observe_propose(0.0, drafted=False)
            undrafted += 1
    assert undrafted == 2 + 4 + 14 + 16 and late.gate.verdicts == 5
    assert late.gate.surplus == pytest.approx(0.020 - 0.040 * 0.8 ** 4 - 0.005 * (1 - 0.8 ** 4))


def test_probation_ends_after_its_verdicts():
    # drafting never pays (a 0.05-token node against 50 ms of drafting):
    # the first 16 verdicts close the gate with no skipped step between
    # them, the 17th backs off (2 steps, then 4)
    ctl = _cold_controller(0.05, DraftGate(probation=16))
    for _ in range(16):
        assert ctl.draft_now()
        _draft_step(ctl, 0.050)
        assert not ctl.gate.open
    assert ctl.draft_now()
    _draft_step(ctl, 0.050)
    assert [ctl.draft_now() for _ in range(3)] == [False, False, True]
    assert ctl.as_dict()["gate_verdicts"] == 17


def test_gate_ignores_the_catch_up_of_the_first_draft_after_a_gap():
    # drafting steps cost 10 ms; the exploring step after two no-draft steps
    # also feeds the held rows (500 ms) and must not count as drafting cost
    ctl = BudgetController()
    ctl.observe_propose(0.010, drafted=True)
    ctl.observe_propose(0.001, drafted=False)
    ctl.observe_propose(0.001, drafted=False)
    ctl.observe_propose(0.500, drafted=True)
    assert ctl.gate.draft_seconds == pytest.approx(0.009)
    ctl.observe_propose(0.010, drafted=True)  # the next drafted step counts
    assert ctl.gate.draft_seconds == pytest.approx(0.009)
    # ... but a step after a gap that was cheaper lowers the estimate (drafting
    # got cheaper while the gate was closed): half-way on probation, a fifth
    # of the way after it
    ctl.observe_propose(0.001, drafted=False)
    ctl.observe_propose(0.006, drafted=True)
    assert ctl.gate.draft_seconds == pytest.approx(0.009 + 0.5 * (0.005 - 0.009))
    ctl.gate.verdicts = ctl.gate.probation
    ctl.observe_propose(0.001, drafted=False)
    ctl.observe_propose(0.005, drafted=True)
    assert ctl.gate.draft_seconds == pytest.approx(0.007 + 0.2 * (0.004 - 0.007))


def test_drafting_cost_on_probation_trusts_a_cheaper_step_at_once():
    """A request's first drafting steps cost what it pays once (its indexes,
    a head fed its prompt): measured first, 23 ms against the usual 10, they
    must not keep drafting priced at 23 ms while only exploring steps come
    to correct it. Worked by hand: on probation a cheaper step halves the
    gap, a dearer one moves a fifth of the way, counted at most twice the
    estimate."""
    gate = DraftGate()
    gate.observe_propose(0.023, drafted=True)
    gate.observe_propose(0.010, drafted=True)
    assert gate.propose_seconds[True] == pytest.approx(0.0165)
    gate.observe_propose(0.010, drafted=True)
    assert gate.propose_seconds[True] == pytest.approx(0.01325)
    gate.observe_propose(0.500, drafted=True)  # a stall: counts as 2 x 13.25 ms
    assert gate.propose_seconds[True] == pytest.approx(0.01325 * 1.2)
    gate.observe_propose(0.001, drafted=False)  # not drafting: a plain average
    gate.observe_propose(0.003, drafted=False)
    assert gate.propose_seconds[False] == pytest.approx(0.001 + 0.2 * 0.002)


def test_drafting_cost_after_probation_is_the_mean_not_the_cheap_end():
    """Warm drafting steps alternating 5 and 15 ms (a batch whose requests
    draft in turns): the estimate must settle about their mean, 10 ms. By
    hand, a moving average of alpha 0.2 alternates between 9.44 ms (after a
    cheap step) and 10.56 ms; trusting cheap steps half-way would settle at
    6.8-8.1 ms, and the gate would charge drafting a third too little."""
    gate = DraftGate(probation=0)
    for _ in range(200):
        gate.observe_propose(0.005, drafted=True)
        assert gate.propose_seconds[True] >= 0.005
        gate.observe_propose(0.015, drafted=True)
    assert gate.propose_seconds[True] == pytest.approx(0.095 / 9, rel=1e-6)
    gate.observe_propose(0.005, drafted=True)
    assert gate.propose_seconds[True] == pytest.approx(0.085 / 9, rel=1e-6)
    gate.observe_propose(0.500, drafted=True)  # a stall still counts at most twice
    assert gate.propose_seconds[True] == pytest.approx(0.085 / 9 * 1.2, rel=1e-6)


def test_exploring_step_is_judged_against_one_requests_drafting():
    # 8 requests drafted at 80 ms of drafting (10 ms each). A closed gate's
    # exploring step drafts for one request: its one node (p = 0.5 at
    # 100 ms plain, 120 ms with the node) pays against 10 ms of drafting
    # (1.5 / 130 ms > 1 / 100 ms) though not against the batch's 80 ms
    # (1.5 / 200 ms)
    model = AcceptanceModel(max_depth=1, max_rank=1, prior_weight=1e-9)
    model.engine.seen[0, 0], model.engine.acc[0, 0] = 1e6, 0.5e6
    cost = StepCost()
    measure(cost, 1, 0.100)
    measure(cost, 2, 0.120)
    ctl = BudgetController(model, cost, gate=DraftGate(probation=0))
    ctl.observe_propose(0.081, drafted=True, requests=8)
    ctl.observe_propose(0.001, drafted=False, requests=0)
    assert ctl.gate.draft_cost(8) == pytest.approx(0.080)
    assert ctl.gate.draft_cost(1) == pytest.approx(0.010)
    assert ctl.gate.draft_cost(0) == 0.0
    ctl.gate.judge(False)  # closed: two skipped steps, then one exploring
    assert [ctl.draft_now() for _ in range(2)] == [False, False]
    assert not ctl.exploring
    assert ctl.draft_now() and ctl.exploring
    ctl.observe_propose(0.5, drafted=True, requests=1)  # catch-up: not counted
    assert ctl.stats.explore_steps == 1
    _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert choice.sizes == [1]
    assert ctl.draft_now() and not ctl.exploring  # it paid: open again


def test_calibration_scales_optimistic_estimates_down_never_up():
    # the model says 0.9 for a one-node tree at depth 1; the kept trees
    # realise 0.3 of that. After enough evidence the controller expects
    # ~0.3 per node, and a node of 0.9 no longer pays for a row costing
    # half a plain step; a pessimistic model is left alone.
    def ctl_for(p, row_ms):
        model = AcceptanceModel(max_depth=1, max_rank=1, prior_weight=1e-9)
        model.engine.seen[0, 0], model.engine.acc[0, 0] = 1e6, p * 1e6
        cost = StepCost()
        measure(cost, 1, 0.100)
        measure(cost, 2, 0.100 + row_ms / 1e3)
        return BudgetController(model, cost)

    def steps(ctl, n, accepted):
        for step in range(n):
            rid = f"r{step}"  # fresh requests: the engine-wide estimate only
            _, choice = ctl.choose([rid], [DraftTree([5], [-1])], [3], rows=1)
            assert choice.sizes == [1]
            ctl.learn(rid, np.arange(3), accepted=accepted(step))
            ctl.forget(rid)

    ctl = ctl_for(0.9, 5.0)  # a row at 5 ms: worth it at any calibration here
    steps(ctl, 300, lambda step: int(step % 10 < 3))
    assert ctl.calibration == pytest.approx(0.3 / 0.9, abs=0.05)
    _, choice = ctl.choose(["x"], [DraftTree([5], [-1])], [3], rows=1)
    assert choice.expected_accepted[0] == pytest.approx(0.9 * ctl.calibration)
    assert ctl.as_dict()["calibration"] == pytest.approx(ctl.calibration, abs=1e-3)
    for _ in range(30):  # rows get dear: 1.9 / 150 ms would pay, 1.3 does not
        ctl.cost.observe(2, 0.150)
    _, choice = ctl.choose(["y"], [DraftTree([5], [-1])], [3], rows=1)
    assert choice.sizes == [0]

    ctl = ctl_for(0.6, 5.0)  # realises more than the model says: not scaled up
    steps(ctl, 50, lambda step: 1)
    assert ctl.calibration == 1.0


def test_exploring_takes_a_bounded_share_of_the_time():
    # exploring steps cost 40 ms (a head's catch-up) against 40 ms plain
    # steps: once the gate has closed three times in a row, at a 2 % share
    # it skips at least 50 steps between them (before: 2, then 4)
    ctl = _one_node_controller(0.05, 50.0)
    assert ctl.gate.bound_after == 3
    ctl.gate.judge(False, 0.040)
    assert [ctl.draft_now() for _ in range(3)] == [False, False, True]
    ctl.observe_propose(0.040, drafted=True, requests=1)
    assert ctl.gate.explore_seconds == pytest.approx(0.040)
    ctl.gate.judge(False, 0.040)
    assert [ctl.draft_now() for _ in range(5)] == [False] * 4 + [True]
    ctl.observe_propose(0.040, drafted=True, requests=1)
    ctl.gate.judge(False, 0.040)
    seen = [ctl.draft_now() for _ in range(51)]
    assert seen == [False] * 50 + [True]


def test_an_exploring_step_that_pays_does_not_end_the_back_off():
    # one request's exploring pays, the batch's drafting next step does not:
    # the back-off goes on doubling instead of starting again at 2
    ctl = _one_node_controller(0.05, 50.0)
    ctl.gate.judge(False)  # skip 2
    ctl.gate.judge(False)  # skip 4
    assert [ctl.draft_now() for _ in range(5)] == [False] * 4 + [True]
    assert ctl.exploring
    ctl.gate.judge(True)
    assert ctl.draft_now() and not ctl.exploring  # open
    ctl.gate.judge(False)
    assert [ctl.draft_now() for _ in range(9)] == [False] * 8 + [True]
    # ... unless the exploring request was the whole batch (batch 1): then
    # it was the batch's drafting, and it paid
    ctl.gate.judge(True, whole_batch=True)
    assert ctl.draft_now() and not ctl.exploring
    ctl.gate.judge(False)
    assert [ctl.draft_now() for _ in range(3)] == [False, False, True]


def test_side_work_counts_as_drafting_cost():
    # a prompt's LM-head pass (done only while drafting) of 80 ms a step on
    # average: a node worth 0.5 tokens on a flat 100 ms step pays for
    # itself (1.5 / 100 ms) but not with the side work (1.5 / 180 ms)
    ctl = _one_node_controller(0.5, 0.0)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert ctl.draft_now()
    for _ in range(300):
        ctl.observe_side(0.080)
    assert ctl.gate.draft_cost(1) == pytest.approx(0.080, rel=0.01)
    assert ctl.as_dict()["side_ms"] == pytest.approx(80.0, rel=0.01)
    # each step: 1.5 tokens of plain decoding's 100 ms each, against 100 ms
    # and 80 ms of side work: -30 ms; the average of drafted steps (+50 ms
    # from the first) turns negative after 5 of them
    for step in range(1, 7):
        _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
        assert choice.sizes == [1]  # sunk by now: the node is still verified
        if not ctl.draft_now():  # but the gate closes
            break
    assert step == 5
    for _ in range(200):  # the side work stops (e.g. no new prompts)
        ctl.observe_side(0.0)
    assert ctl.gate.draft_cost(1) < 0.002
    fresh = BudgetController()
    fresh.observe_side(0.25)  # one long prompt's pass: a share, not a step's cost
    assert fresh.gate.side_seconds == pytest.approx(0.005)


def test_side_work_waits_until_drafting_has_paid_once():
    # A cold engine: the gate is open (nothing judged yet) but no draft has
    # paid, so a prompt's LM-head pass (side work) is not done yet -- a
    # method whose drafts start empty would otherwise pay it over the whole
    # first burst of prompts before any evidence.
    ctl = BudgetController()
    assert ctl.draft_now() and not ctl.side_work
    assert ctl.as_dict()["gate_proven"] is False
    bad = _one_node_controller(0.05, 50.0)  # drafting does not pay
    bad.draft_now()
    bad.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert not bad.side_work
    for _ in range(40):  # closed; exploring steps never do side work
        bad.draft_now()
        assert not bad.side_work
    good = _one_node_controller(0.9, 50.0)  # drafting pays
    assert good.draft_now() and not good.side_work
    good.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert good.draft_now() and good.side_work
    # proven stays proven; a closed gate (and its exploring steps) still
    # skips the side work, an open one does it again
    good.gate.judge(False)
    seen = [(good.draft_now(), good.side_work) for _ in range(3)]
    assert seen == [(False, False), (False, False), (True, False)]
    good.gate.judge(True)
    assert good.draft_now() and good.side_work


def test_reset_learning_makes_the_controller_cold():
    # a warm-up of filler proved drafting; reset_learning makes the
    # controller cold again (gate closed and exploring at once, unproven,
    # prior acceptance, calibration 1, no step cost known: the first step
    # verifies everything)
    ctl = _one_node_controller(0.9, 50.0)
    ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    ctl._cal_expected, ctl._cal_realised = 100.0, 10.0
    assert ctl.gate.proven and ctl.calibration < 1.0
    ctl.reset_learning()
    assert not ctl.gate.proven and not ctl.gate.open and ctl.gate.draft_seconds == 0.0
    assert ctl.draft_now() and ctl.exploring
    assert ctl.calibration == 1.0
    assert ctl.acceptance.rates(None)[0, 0] == pytest.approx(AcceptanceModel().prior)
    assert not ctl.cost.known
    _, choice = ctl.choose(["a"], [DraftTree([5], [-1])], [3], rows=1)
    assert choice.sizes == [1]


def _linear_cost(base_ms: float, per_row_ms: float, upto: int = 40) -> StepCost:
    cost = StepCost()
    for rows in range(1, upto):  # T(R) = base + per_row * (R - 1)
        measure(cost, rows, (base_ms + per_row_ms * (rows - 1)) / 1e3)
    return cost


def test_fixed_budget_keeps_every_tree_and_always_drafts():
    fixed = make_budget(cost_aware=False)
    assert isinstance(fixed, FixedBudget)
    assert fixed.will_draft and fixed.draft_now() and not fixed.exploring and fixed.side_work
    fixed.learn("a", [1, 2, 3], accepted=2)  # learns nothing, fails on nothing
    fixed.observe_step(3, 0.5)
    trees = [TREE, None, DraftTree([], [])]
    out, choice = fixed.choose(["a", "b", "c"], trees, [3, 3, 3], rows=3)
    assert out[0] is TREE and out[1] is None and out[2] is None
    assert choice.sizes == [6, 0, 0]
    assert fixed.token_seconds(3) == 0.0
    assert fixed.reset_learning() is False and fixed.as_dict() is None
    assert isinstance(make_budget(cost_aware=True), BudgetController)


def test_token_seconds_is_a_requests_share_of_a_plain_step():
    ctl = BudgetController(cost=_linear_cost(50, 5))
    assert ctl.token_seconds(2) == pytest.approx(0.055 / 2)  # 55 ms over 2 requests
    assert BudgetController().token_seconds(2) == 0.0  # no step timed yet


def test_sources_are_estimated_apart_and_shrunk_toward_the_pool():
    model = AcceptanceModel(max_depth=2, max_rank=1, prior_weight=1e-9, request_weight=1e-9)
    # a sure source and an unsure one, at depth 1, from two requests
    for i in range(200):
        model.observe("a", [(1, 0, True, "match4")])
        model.observe("b", [(1, 0, i % 10 == 0, "match1")])
    sure, guess = DraftTree([5], [-1], sources=["match4"]), DraftTree([5], [-1], sources=["match1"])
    assert model.node_probs(sure)[0] > 0.95 and model.node_probs(guess)[0] < 0.15
    # without a source a node reads the pooled estimate (~0.55)
    assert 0.5 < model.node_probs(DraftTree([5], [-1]))[0] < 0.6
    # a source seen once reads about the pool (source_weight 8 observations)
    model.observe("c", [(1, 0, True, "match2")])
    new = DraftTree([5], [-1], sources=["match2"])
    assert 0.55 < model.node_probs(new)[0] < 0.65
    # shadow evaluation hands the sources along
    outcomes, done = shadow_outcomes(DraftTree([7, 8], [-1, 0], sources=["m", "m"]), [7, 9])
    assert done and outcomes == [(1, 0, True, "m"), (2, 0, False, "m")]
    model.forget("a")
    assert "a" not in model.request_sources and "a" not in model.requests


def test_exploring_asks_a_request_whose_catch_up_is_cheap():
    from vllm_specplug.engine.budget import CHEAP_CATCH_UP, pick_explorer

    # a model-free method (no held work): plain round robin from the turn
    assert [pick_explorer(t, [0, 0, 0]) for t in range(4)] == [0, 1, 2, 0]
    # requests that sample nothing this step (a prompt chunk) are skipped
    assert [pick_explorer(t, [None, 0, None]) for t in range(3)] == [1, 1, 1]
    assert pick_explorer(5, [None, None]) == -1 and pick_explorer(0, []) == -1
    # a head holding prompts (~700 rows each): the fewest rows first ...
    assert pick_explorer(0, [700, 450, 900]) == 1
    # ... then the explored request, which holds only the steps since
    held = [700 + 20, 12, 900 + 20]
    assert [pick_explorer(t, held) for t in range(3)] == [1, 1, 1]
    # among cheap requests (at most CHEAP_CATCH_UP rows) round robin again
    cheap = [CHEAP_CATCH_UP, 1, 3000, 0]
    assert [pick_explorer(t, cheap) for t in range(4)] == [0, 1, 3, 3]


def test_no_gate_verdict_before_a_plain_step_was_measured():
    # batch 1, the first drafted steps verify 5 rows at 60 ms; plain steps
    # (1 row) take 25 ms but none was measured yet. Below its smallest
    # knot the curve reads 60 ms * 1/5 = 12 ms a plain step: judged on
    # that, a chain worth 2.4 tokens per step would look like a loss and
    # close the gate. There is no verdict until plain's own cost is on the
    # curve (the same reading cuts the trees to nothing, so plain decoding
    # gets measured); then drafting is judged on it, and pays:
    # the best cut keeps 3 nodes (1 + 0.8 + 0.64 + 0.512 = 2.95 tokens in a
    # 4-row step, 25 + 3 * 8.75 = 51.25 ms, 6 ms drafting: 2.95 / 57.25 ms
    # > 1 / 25 ms; a 4th node, 0.41 tokens for 8.75 ms, lowers the rate).
    model = AcceptanceModel(max_depth=4, max_rank=1, prior_weight=1e-9)
    model.engine.seen[:, 0], model.engine.acc[:, 0] = 1e6, 0.8e6
    ctl = BudgetController(model)
    chain = DraftTree([5, 6, 7, 8], [-1, 0, 1, 2])
    measure(ctl.cost, 5, 0.060)
    ctl.observe_propose(0.006, drafted=True)
    assert not ctl.cost.measured_up_to(1) and ctl.cost(1) == pytest.approx(0.012)
    assert ctl.draft_now()
    _, choice = ctl.choose(["a"], [chain], [3], rows=1)
    assert choice.sizes == [0]  # a plain step, to be measured
    assert ctl.draft_now() and ctl.gate._backoff == 1  # no verdict: not closed
    measure(ctl.cost, 1, 0.025)
    _, choice = ctl.choose(["a"], [chain], [3], rows=1)
    assert choice.sizes == [3] and ctl.gate.open
    # batch 8 whose plain steps are never measured (a prompt chunk in every
    # step): no verdict for PLAIN_TRIES steps, then judged on the curve as
    # it is (the empty cut does not pay for the drafting: closed)
    ctl = BudgetController(model)
    measure(ctl.cost, 24, 0.060)
    ctl.observe_propose(0.006, drafted=True)
    for _ in range(PLAIN_TRIES):
        assert ctl.choose(["a"], [chain], [3], rows=8)[1].sizes == [0]
        assert ctl.gate.surplus is None
    ctl.choose(["a"], [chain], [3], rows=8)
    assert ctl.gate.surplus < 0 and not ctl.gate.open
    # rows counted at a knot above them (9 rows: knot 10) are measured there
    cost = StepCost()
    measure(cost, 9, 0.050)
    assert cost.as_dict() == {"10": 50.0}
    assert cost.measured_up_to(9) and cost.measured_up_to(12) and not cost.measured_up_to(7)


def test_gate_log_keeps_the_verdicts_that_closed_or_met_a_closed_gate():
    # Flat 100 ms steps, 5 ms of drafting. A node worth 0.2 tokens (20 ms)
    # opens the cold gate at once (+15 ms); worth 0.01 tokens (1 ms) each
    # step loses 4 ms, and the average (15 ms, then 0.8 of the way to -4 ms
    # per step) turns negative at the seventh such step: one closing, two
    # verdicts logged (the open gate's six in between are not)
    ctl = _cold_controller(0.2, DraftGate(probation=0))
    assert ctl.draft_now()
    _draft_step(ctl, 0.005)
    assert ctl.gate.open
    ctl.acceptance.engine.acc[0, 0] = 0.01e6
    steps = 0
    while ctl.gate.open:
        assert ctl.draft_now()
        _draft_step(ctl, 0.005)
        steps += 1
    assert steps == 7 and ctl.stats.gate_closings == 1
    log = ctl.as_dict()["gate_log"]
    assert len(log) == 2
    first = dict(zip(GATE_LOG_FIELDS, log[0]))
    assert first == pytest.approx(dict(
        verdict=1, exploring=1, rows=1, kept=1, gain_ms=20.0, tree_ms=0.0, draft_ms=5.0,
        surplus_ms=15.0, average_ms=15.0, open_after=1, skip_after=0))
    last = dict(zip(GATE_LOG_FIELDS, log[1]))
    assert last == pytest.approx(dict(
        verdict=8, exploring=0, rows=1, kept=1, gain_ms=1.0, tree_ms=0.0, draft_ms=5.0,
        surplus_ms=-4.0, average_ms=-4.0 + 19.0 * 0.8 ** 7, open_after=0, skip_after=2),
        abs=1e-3)
    # a closed gate's verdicts are all kept, up to the last GATE_LOG
    while ctl.gate.verdicts < 8 + GATE_LOG + 2:
        if ctl.draft_now():
            _draft_step(ctl, 0.005)
        else:
            ctl.observe_propose(0.0, drafted=False)
    assert len(ctl.as_dict()["gate_log"]) == GATE_LOG
    assert ctl.as_dict()["gate_log"][-1][0] == ctl.gate.verdicts
