"""The draft gate: whether a step should draft at all.

Drafting costs time (a head's forward passes, a retrieval) paid before the
cut. The gate measures the proposer's time per step, drafting and not
drafting, and *closes* when the best cuts of the last drafted steps (a
moving average of the seconds each saved, drafting paid) would not have
paid for the drafting on top of their rows: the runner then asks the method
for no draft (every request's budget 0; methods still extend their state).

A closed gate lets one request (round robin, cheap catch-up first:
``pick_explorer``) draft in an *exploring* step after 2, 4, ... up to
``max_skip`` skipped steps, so the acceptance estimates stay fresh and the
gate opens again when drafts start to pay. Drafting's cost is measured per
request asked, so one request's exploring is judged against one request's
drafting. Exploring also pays a head's catch-up, so once the gate has
closed ``bound_after`` times in a row the skips are stretched until
exploring takes at most ``explore_share`` of the time. Drafting-only work
the runner does outside the proposer (a prompt's LM-head pass for methods
that learn from it) counts as drafting cost too, and waits until drafting
has paid once (a cold engine has no evidence yet).

A cold gate is on *probation* for its first ``probation`` verdicts: closed,
it explores on every step instead of backing off. The first verdicts rest
on the dearest measurements an engine makes (a head fed a whole prompt
before its first draft) and on acceptance estimates that are still the
prior; backing off on them leaves the gate closed with few exploring steps
to correct either, each one after a gap whose catch-up may only lower the
drafting cost, never show what a drafting step costs. A workload on which
drafting pays could stay undrafted for hundreds of steps that way.
"""

from __future__ import annotations

import numpy as np

from vllm_specplug.engine.stats import capped_ema, cost_ema, ema


CHEAP_CATCH_UP = 64
"""Rows of catch-up (``Proposer.catch_up_rows``) an exploring request may
need and still take its round-robin turn; see ``pick_explorer``."""


def pick_explorer(turn: int, catch_up: list[int | None], cheap: int = CHEAP_CATCH_UP) -> int:
    """The request a closed gate's exploring step asks for a draft:
    round robin from ``turn`` among the requests whose drafter would first
    have to catch up on at most ``cheap`` rows (``catch_up[i]``; None: the
    request samples nothing this step, so it cannot draft), else the one
    with the fewest; -1 when none can draft.

    Why not plain round robin: a head that held a gated request's rows
    processes them all before that request's first draft, so exploring a
    request whose prompt it still holds costs that prompt's head pass
    (round robin would push every request's prompt through the head while
    the gate stays closed, for drafts that do not pay). A request explored
    once holds only the rows of the steps since, so exploring it again
    costs about one draft. Methods without held work report 0 for every
    request: plain round robin.
    """
    n = len(catch_up)
    best, best_key = -1, None
    for k in range(n):
        i = (turn + k) % n
        rows = catch_up[i]
        if rows is None:
            continue
        key = max(rows, cheap)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best



class DraftGate:
    """Whether the next step should draft at all (see the module docstring)."""

    def __init__(self, alpha: float = 0.2, max_skip: int = 32,
                 explore_share: float = 0.02, max_explore_skip: int = 512,
                 bound_after: int = 3, probation: int = 16) -> None:
        self.alpha = alpha
        self.probation = probation
        """Verdicts (``judge``) a cold gate takes without backing off: closed,
        it explores on every step until then (see the module docstring)."""
        self.verdicts = 0
        """Verdicts taken since start-up (or ``reset_learning``)."""
        self.max_skip = max_skip
        self.explore_share = explore_share
        """At most this share of a closed gate's time goes to exploring: a
        step that explores costs its drafting *and* the catch-up of what a
        head held meanwhile, so exploring every ``max_skip`` steps could
        cost more than drafting is meant to save."""
        self.max_explore_skip = max_explore_skip
        """Longest run of skipped steps the share allows (the estimates must
        not go stale for ever)."""
        self.bound_after = bound_after
        self.max_rise = 2.0
        """A drafting step dearer than the estimate counts at most this many
        times it (see ``_drafting_estimate``)."""
        """Closings in a row (no whole batch's drafting paying in between)
        before ``explore_share`` stretches the skips; until then they are
        2, 4, ... steps."""
        self.explore_seconds: float | None = None
        """Proposer time of an exploring step, catch-up included (EMA)."""
        self.side_seconds: float | None = None
        """Drafting-only work the runner does outside the proposer, per step
        while drafting (slow EMA: it comes in bursts): the LM-head pass over
        new prompts that table-learning methods read (``recycle``,
        ``adapld``, ``graft``), a share of a prompt's prefill that can
        outweigh the extra tokens the drafts it feeds return."""
        self.side_alpha = 0.02
        self.propose_seconds: dict[bool, float | None] = {True: None, False: None}
        """Proposer time per step (EMA), drafting / not drafting."""
        self.drafting_requests: float | None = None
        """Requests asked for a draft per drafting step (EMA, same steps as
        ``propose_seconds[True]``): drafting cost scales with them."""
        self.open = False
        """Starts closed, due to explore at once: until a drafted step has
        paid, one request (round robin) drafts a step, not the batch. A cold
        engine has no evidence that drafting pays, and a batch's first
        drafts are its dearest: a head catches up on every prompt, so
        starting with one request's drafts spares the head the prompts of
        requests whose drafting may never pay. At batch 1 the one request is
        the batch: nothing changes there."""
        self.proven = False
        """Some drafted step has paid for its drafting. Until then the
        runner skips drafting-only side work (a prompt's LM-head pass): the
        gate is only judged on steps that verify a tree, so
        a method whose drafts start empty (``recycle``'s table) would
        otherwise pay the pass over the whole first burst of prompts before
        any evidence, even on a workload where drafting never pays."""
        self.surplus: float | None = None
        """Moving average of drafted steps' ``surplus`` (``judge``) while
        the gate is open."""
        self._skip = 0  # steps to skip before the next exploring step (0: explore now)
        self._backoff = 1
        self._drafted_last = True
        self.exploring = False
        """This step is a closed gate's exploring step: the runner asks
        only one request for a draft (round robin), so exploring costs one
        request's drafting (and a head's catch-up of one request's held
        rows), not the batch's."""

    def observe_propose(self, seconds: float, drafted: bool, requests: int = 1) -> None:
        """The proposer's time this step, whether it was asked to draft, and
        for how many requests."""
        follows_gap = drafted and not self._drafted_last
        self._drafted_last = drafted
        if drafted and self.exploring:
            self.explore_seconds = ema(self.explore_seconds, seconds, self.alpha)
        if follows_gap:
            # The first draft after no-draft steps also feeds a head the
            # rows it held meanwhile (one batched catch-up): counting it
            # whole would keep the gate closed (a catch-up can cost more
            # than a whole step). A catch-up only makes the step look
            # dearer, so such a step may lower the estimate, never raise it:
            # a closed gate's drafting cost would otherwise stay what it was
            # when the gate closed, though drafting may have got cheaper
            # since.
            on, n, off = self.propose_seconds[True], self.drafting_requests, \
                self.propose_seconds[False] or 0.0
            if on is not None and n and requests > 0:
                equiv = off + (seconds - off) * n / requests  # at n requests
                if equiv < on:
                    self.propose_seconds[True] = self._drafting_estimate(on, equiv)
            return
        if drafted:
            self.propose_seconds[True] = self._drafting_estimate(self.propose_seconds[True],
                                                                 seconds)
            self.drafting_requests = ema(self.drafting_requests, requests, self.alpha)
        else:
            self.propose_seconds[False] = ema(self.propose_seconds[False], seconds, self.alpha)

    def _drafting_estimate(self, old: float | None, seconds: float) -> float:
        """A drafting step's time into the estimate: a moving average
        (``alpha``) that counts a step at most ``max_rise`` times the
        estimate, so one stall cannot price drafting out.

        On probation a cheaper step moves it half-way at once: a request's
        first drafts build its indexes and feed its prompt to a head, and
        counted like any step they would keep drafting priced out while
        only exploring steps came to correct it. After probation cheap and
        dear steps count alike: a drafting step's time varies threefold at
        batch 8 (how many requests draft, a head's catch-up), and an
        estimate that kept trusting the cheap ones settled at half of what
        drafting steps cost and kept drafting where it did not pay."""
        rule = cost_ema if self.verdicts < self.probation else capped_ema
        return rule(old, seconds, self.alpha, self.max_rise)

    def observe_side(self, seconds: float) -> None:
        """Drafting-only work outside the proposer this (drafting) step."""
        # from 0, not from the first value: a step's burst is 50 steps' share
        self.side_seconds = ema(self.side_seconds or 0.0, seconds, self.side_alpha)

    @property
    def draft_seconds(self) -> float:
        """What drafting adds to a step: proposer time drafting minus not
        drafting (all of it until a non-drafting step was measured)."""
        on, off = self.propose_seconds[True], self.propose_seconds[False]
        if on is None:
            return 0.0
        return max(0.0, on - (off or 0.0))

    def draft_cost(self, requests: int) -> float:
        """What drafting for ``requests`` requests adds to a step: the
        measured drafting cost, scaled by requests (an exploring step
        drafts for one)."""
        if requests <= 0:
            return 0.0
        n = self.drafting_requests
        # the side work is the batch's (new prompts), charged whole: an
        # exploring step that opens the gate brings it back
        return self.draft_seconds * (requests / n if n else 1.0) + (self.side_seconds or 0.0)

    def judge(self, pays: bool = False, step_seconds: float = 0.0,
              whole_batch: bool = False, surplus: float | None = None) -> None:
        """After a drafted step: did its best cut pay for the drafting?
        ``pays``: the step's verdict alone, read only without ``surplus``;
        ``step_seconds``: a plain step's time (bounds exploring's share);
        ``whole_batch``: every decoding request drafted (an exploring step
        at batch 1 is the batch's drafting); ``surplus``: seconds the step's
        best cut saved over plain decoding, drafting paid (negative: lost).

        With ``surplus`` an open gate is judged on its moving average, not
        on the step alone: a step whose best cut is empty loses only its
        drafting, which for a model-free method is a small share of a step,
        while closing the gate on it skips the next steps' drafts, paying
        ones included. A closed gate's exploring step is judged alone and, if it
        pays, restarts the average."""
        self.verdicts += 1
        if surplus is not None:
            if self.open and self.surplus is not None:
                self.surplus = ema(self.surplus, surplus, self.alpha)
            else:
                self.surplus = surplus
            pays = self.surplus > 0
        if pays:
            self.open = True
            self.proven = True
            if not self.exploring or whole_batch:
                # only a whole batch's drafting that pays ends the back-off:
                # one request's exploring may pay where the batch's does not,
                # and resetting on it would alternate between drafting for
                # all and skipping 2 steps, again and again
                self._backoff = 1
            return
        self.open = False
        if self.on_probation:
            self._skip = 0  # explore the next step: see the module docstring
            return
        self._backoff = min(2 * self._backoff, self.max_skip)
        self._skip = self._backoff
        # The share bound only after `bound_after` closings without a whole
        # batch's drafting paying in between: a single step that does not pay
        # is often one unlucky draft, and stretching the skips after it
        # would leave a workload whose drafts usually pay undrafted for
        # dozens of steps.
        if (self._backoff >= 1 << self.bound_after and self.explore_seconds
                and step_seconds > 0):
            floor = self.explore_seconds / (self.explore_share * step_seconds)
            self._skip = max(self._skip, min(int(np.ceil(floor)), self.max_explore_skip))

    @property
    def on_probation(self) -> bool:
        """Still a cold gate's first ``probation`` verdicts (the one just
        taken included)."""
        return self.verdicts <= self.probation

    @property
    def skip_left(self) -> int:
        """Steps a closed gate will skip before it explores again."""
        return 0 if self.open else max(0, self._skip)

    @property
    def side_work(self) -> bool:
        """Do drafting-only side work this step? Only with the gate open,
        outside an exploring step (one decoding request drafts there), and
        once drafting has paid at least once."""
        return self.open and self.proven and not self.exploring

    @property
    def will_draft(self) -> bool:
        """What the step's ``draft_now`` will answer, without counting a
        skip: read earlier in the step (the runner's sampling), to leave
        out the drafting-only inputs of a step that drafts nothing."""
        return self.open or self._skip <= 0

    def draft_now(self) -> bool:
        """Ask the method for drafts this step? (exploring once a closed
        gate has skipped its steps)"""
        # one predicate for both: the runner's earlier peek must agree
        if not self.will_draft:
            self._skip -= 1
            self.exploring = False
            return False
        self.exploring = not self.open  # judge() decides again after this step
        return True

