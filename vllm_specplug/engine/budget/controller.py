"""The cost-aware controller: how much of each proposed tree to verify.

A draft node costs a verified row whether it is accepted or not. Where a
step's time grows with its rows (a CPU, a busy GPU), a tree whose nodes are
unlikely to be accepted makes the step slower than the tokens it returns.
The controller, shared by every method, cuts each step's trees (to zero
nodes if need be) to maximise

    expected tokens per second = (requests + sum of P(node accepted)) / T(rows)

with ``T`` from ``cost.StepCost`` and ``P`` from
``acceptance.AcceptanceModel`` (fed by ``shadow.shadow_outcomes``). Since a
node is never likelier than its parent, taking nodes in decreasing
probability keeps every prefix *rooted* (each kept node's parent is kept),
and the best cut is the best prefix of that order. Where the kept trees
realise fewer tokens than expected (the cut selects the nodes whose
estimates are high, luck included), every estimate is scaled by
realised/expected (never up). After each cut it tells ``gate.DraftGate``
whether the cut paid for the drafting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.engine.budget.acceptance import AcceptanceModel
from vllm_specplug.engine.budget.cost import StepCost
from vllm_specplug.engine.budget.gate import DraftGate
from vllm_specplug.engine.budget.shadow import shadow_outcomes
from vllm_specplug.engine.tree import DraftTree


def subtree(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The nodes ``keep`` (a rooted bool mask: each kept node's parent is
    kept), in tree order."""
    index: dict[int, int] = {}
    tokens, parents = [], []
    for i in np.flatnonzero(keep):
        index[int(i)] = len(tokens)
        tokens.append(tree.tokens[i])
        p = tree.parents[i]
        parents.append(-1 if p < 0 else index[p])
    pick = [int(i) for i in np.flatnonzero(keep)]
    return DraftTree(
        tokens, parents,
        None if tree.scores is None else [tree.scores[i] for i in pick],
        None if tree.sources is None else [tree.sources[i] for i in pick],
    )


def _candidates(trees, probs) -> list[tuple[float, int, int, int]]:
    """Every node of every tree as ``(-P(accepted), depth, request, node)``,
    sorted: likeliest first, shallower first among ties. A child is never
    likelier than its parent, so every prefix of this order is rooted (each
    kept node's parent is kept)."""
    cand: list[tuple[float, int, int, int]] = []
    for j, (tree, p) in enumerate(zip(trees, probs)):
        if p is None:
            continue
        depths = tree.depths()
        cand.extend((-float(p[i]), int(depths[i]), j, i) for i in range(len(tree)))
    cand.sort()
    return cand


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


PLAIN_TRIES = 4
"""Steps a knot's plain decoding may go unmeasured before the gate is
judged on the curve as it is (a knot joins the curve on its second step)."""


@dataclass
class Choice:
    """What the controller chose for one step (for stats and tests)."""

    sizes: list[int]
    expected_accepted: list[float]
    expected_rate: float
    """Expected tokens per second of the chosen step (0 before any timing,
    and in a step with no tree to weigh)."""
    plain_rate: float


@dataclass
class BudgetStats:
    steps: int = 0
    chosen_nodes: int = 0
    proposed_nodes: int = 0
    expected_accepted: float = 0.0
    realised_accepted: int = 0
    zero_steps: int = 0
    """Steps where every request was cut to nothing (plain decoding)."""
    gated_steps: int = 0
    """Steps the gate asked the method for no draft at all (drafting would
    not have paid for its own time)."""
    explore_steps: int = 0
    """Steps a closed gate let one request draft, to see whether drafting
    pays again."""
    gate_closings: int = 0
    """Verdicts that closed an open gate (after probation's)."""
    size_hist: dict[int, int] = field(default_factory=dict)


GATE_LOG = 8
"""Verdicts ``BudgetController.gate_log`` keeps."""

GATE_LOG_FIELDS = ("verdict", "exploring", "rows", "kept", "gain_ms", "tree_ms",
                   "draft_ms", "surplus_ms", "average_ms", "open_after", "skip_after")
"""What each ``gate_log`` entry holds, in order: the verdict's number since
start-up; whether it judged an exploring step; decoding rows and kept
nodes; what the kept nodes' expected tokens save (plain decoding's time for
them), what their rows add to a plain step and what the drafting costs (the
gate's estimate), in ms; the step's surplus (gain - rows - drafting) and
the gate's moving average of it after this verdict, in ms; the gate's state
after (open, steps it skips before exploring again)."""


class BudgetController:
    """Chooses each step's tree size per request (see the module docstring)."""

    def __init__(self, acceptance: AcceptanceModel | None = None,
                 cost: StepCost | None = None, max_pending: int = 16,
                 gate: DraftGate | None = None) -> None:
        self.max_pending = max_pending
        self._cal_decay = 0.5 ** (1.0 / 200)
        self.stats = BudgetStats()
        self._start(acceptance, cost, gate)

    def _start(self, acceptance: AcceptanceModel | None = None,
               cost: StepCost | None = None, gate: DraftGate | None = None) -> None:
        """Everything the controller learns, fresh (start-up and
        ``reset_learning``)."""
        self.acceptance = acceptance or AcceptanceModel()
        self.cost = cost or StepCost()
        self.gate = gate or DraftGate()
        self._pending: dict[str, list[tuple[int, DraftTree]]] = {}
        self._expected: dict[str, float] = {}  # the model's, uncalibrated
        # Calibration: the acceptance model's expected accepted tokens of the
        # kept trees vs what they realised (decayed sums). The model can be
        # optimistic where the cut selects (a request's few lucky outcomes
        # make its estimate high); only ever scaled down, so a calibrated
        # controller drafts no more than the model alone would. Half-life
        # 200 kept trees (``_cal_decay``): a workload's change must show
        # within a few requests (a method whose deep branch is accepted on
        # one workload and not on the next must not keep the first one's
        # calibration).
        self._cal_expected, self._cal_realised = 0.0, 0.0
        self._plain_tries: dict[int, int] = {}
        """Steps left without a gate verdict, per knot
        (``_plain_unmeasured``)."""
        self.gate_log: deque[list] = deque(maxlen=GATE_LOG)
        """The last verdicts that found the gate closed or closed it
        (``GATE_LOG_FIELDS``), with what they weighed: an engine whose gate
        stays shut on a workload where drafting pays shows whether the
        expected gain fell or the drafting's estimated cost rose. An open
        gate's verdicts that keep it open are not kept."""

    # -------------------------------------------------------------- learning
    def learn(self, req_id: str, token_ids, accepted: int | None = None) -> None:
        """Evaluate the request's pending proposals against its history
        ``token_ids`` (prompt + output so far). ``accepted``: tokens the last
        verified tree of this request accepted (for expected-vs-realised)."""
        if accepted is not None and req_id in self._expected:
            self.stats.realised_accepted += accepted
            model = self._expected.pop(req_id)
            d = self._cal_decay
            self._cal_expected = d * self._cal_expected + model
            self._cal_realised = d * self._cal_realised + accepted
        pending = self._pending.get(req_id)
        if not pending:
            return
        n = len(token_ids)
        left = []
        for root_len, tree in pending:
            outcomes, done = shadow_outcomes(tree, token_ids[root_len:n])
            if done:
                self.acceptance.observe(req_id, outcomes)
            else:
                left.append((root_len, tree))
        self._pending[req_id] = left[-self.max_pending:]

    @property
    def calibration(self) -> float:
        """Realised per expected accepted token of the kept trees, at most 1
        (5 tokens of prior evidence at 1)."""
        return min(1.0, (self._cal_realised + 5.0) / (self._cal_expected + 5.0))

    def reset_learning(self) -> bool:
        """Forget everything the controller learned (acceptance estimates,
        calibration, the gate and its drafting costs, the step-cost curve);
        its counters stay. For a warm-up that must not teach: a warm-up on
        filler text (run so that first-use costs of new shapes do not land
        on the first real prompts) would teach the gate that drafting pays
        -- repetitive filler is drafted almost perfectly -- so the first
        real prompts would meet a proven, open gate instead of a cold
        engine's, and pay drafting-only side work before any evidence; and
        a warm-up that shares the CPU with another process measures steps
        far dearer than the real ones. True: there was learning to forget."""
        self._start()
        return True

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._expected.pop(req_id, None)
        self.acceptance.forget(req_id)

    def token_seconds(self, rows: int) -> float:
        """What an accepted token saves at ``rows`` decoding requests: a
        request's share of a plain step (0 while no step was timed)."""
        if not self.cost.known or rows <= 0:
            return 0.0
        return self.cost(rows) / rows

    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def draft_now(self) -> bool:
        """Whether the runner should ask the method for drafts this step."""
        ok = self.gate.draft_now()
        if not ok:
            self.stats.gated_steps += 1
        return ok

    @property
    def will_draft(self) -> bool:
        """Whether this step's ``draft_now`` will ask for drafts (a peek,
        before it is called)."""
        return self.gate.will_draft

    @property
    def exploring(self) -> bool:
        """The step ``draft_now`` allowed is a closed gate's exploring step
        (the runner then asks one request for a draft)."""
        return self.gate.exploring

    @property
    def side_work(self) -> bool:
        """Do drafting-only side work this step (read after ``draft_now``)?"""
        return self.gate.side_work

    def observe_side(self, seconds: float) -> None:
        """Drafting-only work the runner did outside the proposer this
        drafting step (see ``DraftGate.side_seconds``)."""
        self.gate.observe_side(seconds)

    def observe_propose(self, seconds: float, drafted: bool, requests: int = 1) -> None:
        """The proposer's time this step, whether it was asked to draft,
        and for how many requests."""
        self.gate.observe_propose(seconds, drafted, requests)
        if drafted and self.gate.exploring:
            self.stats.explore_steps += 1

    # -------------------------------------------------------------- choosing
    def choose(self, req_ids: list[str], trees: list[DraftTree | None],
               token_lens: list[int], rows: int) -> tuple[list[DraftTree | None], Choice]:
        """Cut ``trees`` (one per request, None = no draft). ``token_lens``:
        each request's history length (where its tree's root sits);
        ``rows``: rows the next step verifies without any draft (one per
        decoding request; 0 in a step of prompt chunks only)."""
        if not any(t is not None and len(t) for t in trees):
            # nothing to weigh (the gate closed): the step costs no reading
            # of the curve
            none = [0] * len(trees)
            self._record(none, [0.0] * len(trees), 0)
            return [None] * len(trees), Choice(none, [0.0] * len(trees), 0.0, 0.0)
        probs = self._node_probs(req_ids, trees, token_lens)
        order = _candidates(trees, probs)
        cal = self.calibration
        plain = rows / self.cost(rows) if self.cost.known and rows > 0 else 0.0
        best_k, best_rate = self._best_prefix(order, rows, cal, plain)
        if rows > 0 and order and self.cost.known and not self._plain_unmeasured(rows):
            self._judge_gate(order[:best_k], trees, rows, cal, plain)
        keep = [np.zeros(len(t), dtype=bool) if t is not None else None for t in trees]
        for _, _, j, i in order[:best_k]:
            keep[j][i] = True
        return self._cut(req_ids, trees, probs, keep, cal, best_rate, plain)

    def _plain_unmeasured(self, rows: int) -> bool:
        """No gate verdict this step: plain decoding's own step at ``rows``
        is not measured yet. Below its smallest measured knot the curve is
        optimistic (every row as cheap as there, so that smaller trees get
        tried), and a drafted step judged on that (a 17-row step's 54 ms
        read as 3 ms a plain step) closes the gate on no evidence. The same
        reading makes the cut empty (no draft beats plain decoding's rate
        there), so the next steps measure plain decoding. At most
        ``PLAIN_TRIES`` steps per knot: where steps are never all decode
        (prompt chunks in every one) none is measured, and the step is
        judged on the curve as it is."""
        knot = self.cost.knot_of(rows)
        if self.cost.measured_up_to(rows):
            self._plain_tries.pop(knot, None)
            return False
        tries = self._plain_tries.get(knot, 0)
        if tries >= PLAIN_TRIES:
            return False
        self._plain_tries[knot] = tries + 1
        return True

    def _node_probs(self, req_ids, trees, token_lens) -> list[np.ndarray | None]:
        """Each tree's node acceptance probabilities (None: no tree); every
        tree is kept for shadow evaluation, cut or not."""
        probs: list[np.ndarray | None] = []
        for j, (rid, tree) in enumerate(zip(req_ids, trees)):
            if tree is None or not len(tree):
                probs.append(None)
                continue
            self._pending.setdefault(rid, []).append((token_lens[j], tree))
            probs.append(self.acceptance.node_probs(tree, rid))
        return probs

    def _best_prefix(self, order, rows: int, cal: float,
                     plain: float) -> tuple[int, float]:
        """How many of ``order``'s nodes to keep, and the expected tokens per
        second of that step (plain decoding's rate: keep none)."""
        best_k, best_rate, gain = 0, plain, float(rows)
        for k, (neg_p, _, _, _) in enumerate(order, 1):
            if not self.cost.known:
                best_k = k  # no timing yet: verify everything, learn its cost
                continue
            gain += -neg_p * cal
            rate = gain / self.cost(rows + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def _judge_gate(self, kept, trees, rows: int, cal: float, plain: float) -> None:
        """Tell the gate whether this step's best cut paid for the drafting:
        the seconds saved are plain decoding's time for the expected tokens
        minus this step's time, drafting included (> 0 exactly when the cut
        is not empty and its rate with the drafting beats plain decoding's)."""
        best_gain = rows + cal * sum(-c[0] for c in kept)
        drafted = sum(1 for t in trees if t is not None and len(t))
        gain, tree_step = best_gain / plain, self.cost(rows + len(kept))
        drafting = self.gate.draft_cost(drafted)
        surplus = gain - tree_step - drafting
        was_open, exploring = self.gate.open, self.gate.exploring
        self.gate.judge(step_seconds=self.cost(rows), whole_batch=drafted >= rows,
                        surplus=surplus)
        if was_open and self.gate.open:
            return
        if was_open and not self.gate.on_probation:
            self.stats.gate_closings += 1
        plain_step = self.cost(rows)
        self.gate_log.append([
            self.gate.verdicts, int(exploring), rows, len(kept), _ms(gain - plain_step),
            _ms(tree_step - plain_step), _ms(drafting), _ms(surplus), _ms(self.gate.surplus),
            int(self.gate.open), self.gate.skip_left])

    def _cut(self, req_ids, trees, probs, keep, cal: float, best_rate: float,
             plain: float) -> tuple[list[DraftTree | None], Choice]:
        """Each request's kept nodes as a tree, and the step's ``Choice``."""
        out: list[DraftTree | None] = []
        sizes, expected = [], []
        for j, (rid, tree) in enumerate(zip(req_ids, trees)):
            if tree is None or not keep[j].any():
                out.append(None)
                sizes.append(0)
                expected.append(0.0)
                continue
            cut = subtree(tree, keep[j])  # rooted: see _candidates
            model = float(probs[j][keep[j]].sum())
            out.append(cut)
            sizes.append(len(cut))
            expected.append(cal * model)
            self._expected[rid] = model
        self._record(sizes, expected, sum(len(t) for t in trees if t is not None))
        return out, Choice(sizes, expected, best_rate, plain)

    def _record(self, sizes, expected, proposed) -> None:
        s = self.stats
        s.steps += 1
        s.chosen_nodes += sum(sizes)
        s.proposed_nodes += proposed
        s.expected_accepted += sum(expected)
        if proposed and not any(sizes):
            s.zero_steps += 1
        for n in sizes:
            s.size_hist[n] = s.size_hist.get(n, 0) + 1

    def as_dict(self) -> dict:
        d = dict(self.stats.__dict__)
        d["size_hist"] = dict(self.stats.size_hist)
        d["step_ms_by_rows"] = self.cost.as_dict()
        d["draft_ms"] = round(1e3 * self.gate.draft_seconds, 3)
        d["explore_ms"] = round(1e3 * (self.gate.explore_seconds or 0.0), 3)
        d["side_ms"] = round(1e3 * (self.gate.side_seconds or 0.0), 3)
        d["gate_proven"] = self.gate.proven  # drafting has paid at least once
        d["gate_verdicts"] = self.gate.verdicts
        d["gate_log"] = [list(e) for e in self.gate_log]
        d["calibration"] = round(self.calibration, 3)
        d["acceptance_by_depth_rank"] = np.round(self.acceptance.rates(None), 3).tolist()
        # per source: the first level's best-ranked estimate and its evidence
        d["acceptance_by_source"] = {
            src: [round(float(self.acceptance.rates(None, src)[0, 0]), 3),
                  round(float(rates.seen.sum()), 1)]
            for src, rates in sorted(self.acceptance.sources.items())}
        return d
