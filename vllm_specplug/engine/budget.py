"""Cost-aware draft budget: how much of each proposed tree is worth verifying.

A draft node costs a verified row whether it is accepted or not. On a GPU a
step's time barely grows with its rows; on a CPU, or on a busy GPU, it grows
with every row, and a tree whose nodes are unlikely to be accepted makes the
step slower than the tokens it returns. One controller, shared by every
method, cuts each step's trees (to zero nodes if need be) to maximise

    expected tokens per second = (requests + sum of P(node accepted)) / T(rows)

where ``T`` is the step time as a function of the rows the target verifies,
learned online from the engine's own steps, and ``P(node accepted)`` comes
from the acceptance the engine has observed.

Acceptance is estimated without verifying anything extra ("shadow"
evaluation): every proposed tree, cut or not, is compared with the tokens the
target actually produced after its root once they are known. A node is
accepted exactly when its parent was and its token is the next true token
(greedy: the target's argmax; sampling: the sampled token, which the lossless
tree rule accepts with probability ``p(token)``, the probability a sample
equals it). From those outcomes the controller keeps
``P(accepted | parent accepted)`` by depth and sibling rank, for the whole
engine and per request (shrunk toward the engine's figure while a request has
few observations); a node's acceptance is the product along its path.
Where the trees the controller kept realise fewer tokens than it expected
(the cut selects the nodes whose estimates are high, luck included), every
estimate is scaled by realised/expected (never up).

What an accepted token is worth depends on whether anything waits for the
batch's slots. With requests waiting (an open workload) a request that
finishes early lets the next one in, so every accepted token is worth a
decoding request's share of a step, ``T(rows) / rows``: the objective above.
With nothing waiting (a closed batch, or a server draining), the batch's
steps run until its *longest* request is done: an accepted token of a
request with fewer tokens left than the longest only takes that request's
row out of a later step (the step's marginal row cost), and only the
requests with the most tokens left (``max_tokens``) also shorten the batch
(the step's fixed cost, shared among them). Counting every accepted token
as a request's share of a step there overstates what drafting saves -- a
batch runs as many steps as its longest request needs, however many tokens
its shorter requests accept -- and can make drafting slower than plain
decoding while the objective says it pays. So each request's
accepted tokens are weighted by ``(marginal + fixed * longest / n_longest)
/ (T(rows) / rows)`` (1 at batch 1, and for every request of a batch whose
tokens are accepted evenly) unless the runner saw a request replaced by a
waiting one recently. Requests that stop at an end-of-sequence token
before ``max_tokens`` make the tokens left a poor guide to which request
finishes last, so the weight is blended with 1 by the share of recent
requests that ran to their ``max_tokens``.

Step time: knots over the number of verified rows, each an exponential
moving average of the decode steps measured there. Where no step has been
measured yet the curve is extrapolated: above the largest measured point
along the measured points' average slope (flat while only one point is
known), below the smallest optimistically (proportional), and it never
falls as rows grow (a knot dearer than a larger one is a one-off and
leaves the curve), so the controller
tries sizes it does not know yet and learns their cost instead of never
leaving the sizes it has seen.

Drafting itself costs time (a head's forward passes, a retrieval), paid
before the cut. The controller also measures the proposer's time per step,
drafting and not drafting, and closes a *gate* when the best cuts of the
last drafted steps (a moving average of the seconds each saved, drafting
paid) would not have paid for the drafting on top of their rows:
the runner then asks the method for no draft (every request's budget 0;
methods still extend their state). A closed gate lets one request (round
robin) draft in an exploring step after 2, 4, ... up to ``max_skip`` steps,
so the acceptance estimates stay fresh and the gate opens again when drafts
start to pay; drafting's cost is measured per request asked, so one
request's exploring is judged against one request's drafting. Exploring
also pays a head's catch-up, so once the gate has closed ``bound_after``
times in a row the skips are stretched until exploring takes at most
``explore_share`` of the time. Drafting-only work the runner
does outside the proposer (a prompt's LM-head pass for methods that learn
from it) counts as drafting cost too, and waits until drafting has paid
once (a cold engine has no evidence yet).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.engine.stats import ema
from vllm_specplug.engine.tree import DraftTree


class StepCost:
    """Step time (seconds) vs rows verified in the step, learned online.

    A knot's first step may pay one-time costs (a new shape's kernels can
    make it cost twice what the size's later steps do), so its second step
    replaces it instead of averaging with it. The controller only visits the
    sizes it believes pay, so a knot measured too dear would never be
    measured again: a knot not observed for ``stale_after`` steps leaves the
    curve (which is then optimistic there) and its next step replaces it."""

    def __init__(self, max_rows: int = 1 << 16, ratio: float = 2 ** 0.25,
                 alpha: float = 0.2, stale_after: int = 256) -> None:
        knots, r = [1], 1.0
        while knots[-1] < max_rows:
            r *= ratio
            if round(r) > knots[-1]:
                knots.append(int(round(r)))
        self.knots = knots
        self.alpha = alpha
        self.stale_after = stale_after
        self.value = np.zeros(len(knots))
        self.count = np.zeros(len(knots), dtype=np.int64)
        self.last = np.zeros(len(knots), dtype=np.int64)  # clock when observed
        self.clock = 0  # steps observed
        self._refresh()

    def _refresh(self) -> None:
        # The curve only changes when a step is observed, while the
        # controller reads it once per candidate node (hundreds a step at
        # batch 8): keep the fresh knots' points instead of selecting them
        # on every read.
        self._fresh = np.flatnonzero((self.count > 0)
                                     & (self.clock - self.last <= self.stale_after))
        # Verifying more rows never makes a step cheaper, so a knot dearer
        # than a larger one is a one-off (a stall, a new shape, a warm-up
        # beside another process) that its size's rare visits do not
        # correct (at batch 8 the few-row sizes only come up in a burst's
        # tail). Kept, it makes plain decoding look many times dearer than
        # it is, and the controller drafts huge trees that run slower than
        # plain decoding. Such a knot leaves the curve, which is read there
        # from its consistent neighbours. It is not read at the larger
        # knot's value instead: plain decoding's rows would then look as
        # dear as the larger drafted steps, drafting those extra rows would
        # look free, the gate would never close, and the dear knot would
        # never be measured again, because the controller would never stop
        # drafting.
        ys = self.value[self._fresh]
        ok = ys <= np.minimum.accumulate(ys[::-1])[::-1]
        self._seen = self._fresh[ok]
        self._xs = np.asarray(self.knots, dtype=float)[self._seen]
        self._ys = ys[ok]

    def _knot(self, rows: int) -> int:
        i = bisect.bisect_left(self.knots, rows)
        if i == len(self.knots):
            return i - 1
        if i > 0 and rows - self.knots[i - 1] < self.knots[i] - rows:
            return i - 1
        return i

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        k = self._knot(rows)
        self.clock += 1
        if self.count[k] <= 1 or self.clock - self.last[k] > self.stale_after:
            self.value[k] = seconds
        else:
            self.value[k] += self.alpha * (seconds - self.value[k])
        self.count[k] += 1
        self.last[k] = self.clock
        self._refresh()

    @property
    def known(self) -> bool:
        return bool(self.count.any())

    def __call__(self, rows: int) -> float:
        """Estimated step time at ``rows``; 0 when nothing was measured yet."""
        xs, ys = self._xs, self._ys
        if xs.size == 0:
            return 0.0
        if rows >= xs[-1]:
            # Along the measured curve's average slope (flat on a GPU, where
            # rows are nearly free; flat with one point), not flat at the
            # largest known value: an engine that knows only a warm-up's
            # small sizes would then take trees of many times those rows as
            # no dearer, and verify steps several times plain decoding's.
            slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if xs.size > 1 else 0.0
            return float(ys[-1] + slope * (rows - xs[-1]))
        if rows <= xs[0]:
            # optimistic: proportional (never 0: callers divide by it)
            return float(ys[0] * max(rows, 1) / xs[0])
        return float(np.interp(rows, xs, ys))

    def as_dict(self) -> dict:
        """The measured knots (ms), those left out of the curve included."""
        return {str(self.knots[i]): round(1e3 * float(self.value[i]), 3) for i in self._fresh}


@dataclass
class _Rates:
    """Counts of (accepted, seen) per (depth, rank) bucket."""

    acc: np.ndarray
    seen: np.ndarray

    @classmethod
    def empty(cls, depths: int, ranks: int) -> _Rates:
        return cls(np.zeros((depths, ranks)), np.zeros((depths, ranks)))

    def decay(self, factor: float) -> None:
        self.acc *= factor
        self.seen *= factor


class AcceptanceModel:
    """``P(node accepted | parent accepted)`` by depth and sibling rank, and
    by the node's source where the tree names one (``DraftTree.sources``).

    A source is the method's own word for how sure a node is: `pld` names
    its chain by the length of the context match it copies (a 4-token match
    is accepted far more often than a 1-token one), `graft`/`respec` their
    retrieved nodes. Without sources every node of a depth and rank shares
    one estimate, so the cut could not tell a sure copy from a guess, and
    would verify weak matches' nodes along with the sure ones, paying rows
    for tokens a shorter draft gets as well. A source's
    estimates are shrunk toward the engine's pooled ones while it has little
    evidence (``source_weight`` observations), a request's toward its
    source's (``request_weight``)."""

    def __init__(self, max_depth: int = 8, max_rank: int = 4, prior: float = 0.3,
                 prior_weight: float = 2.0, request_weight: float = 8.0,
                 half_life: float = 2000.0, source_weight: float = 8.0) -> None:
        self.max_depth, self.max_rank = max_depth, max_rank
        self.prior, self.prior_weight = prior, prior_weight
        self.request_weight = request_weight
        self.source_weight = source_weight
        # forget old evidence slowly: the workload changes over a server's life
        self._decay = 0.5 ** (1.0 / half_life)
        self.engine = _Rates.empty(max_depth, max_rank)
        self.requests: dict[str, _Rates] = {}
        self.sources: dict[str, _Rates] = {}
        self.request_sources: dict[str, dict[str, _Rates]] = {}

    def _bucket(self, depth: int, rank: int) -> tuple[int, int]:
        return min(depth, self.max_depth) - 1, min(rank, self.max_rank - 1)

    def rates(self, req_id: str | None, source: str | None = None) -> np.ndarray:
        """``[max_depth, max_rank]`` conditional acceptance estimates (of the
        nodes of ``source``, if given)."""
        e = self.engine
        base = (e.acc + self.prior * self.prior_weight) / (e.seen + self.prior_weight)
        if source is None:
            r = self.requests.get(req_id) if req_id is not None else None
        else:
            s = self.sources.get(source)
            if s is not None:
                base = (s.acc + base * self.source_weight) / (s.seen + self.source_weight)
            r = self.request_sources.get(req_id, {}).get(source) if req_id is not None else None
        if r is None:
            return base
        return (r.acc + base * self.request_weight) / (r.seen + self.request_weight)

    def node_probs(self, tree: DraftTree, req_id: str | None = None) -> np.ndarray:
        """Unconditional acceptance probability of every node (product of the
        conditional estimates along its path); never above its parent's."""
        by_source: dict[str | None, np.ndarray] = {}
        ranks = sibling_ranks(tree)
        out = np.empty(len(tree))
        for i, p in enumerate(tree.parents):
            src = tree.sources[i] if tree.sources is not None else None
            rates = by_source.get(src)
            if rates is None:
                rates = by_source[src] = self.rates(req_id, src)
            depth = 1 if p < 0 else _depth_of(tree, i)
            d, r = self._bucket(depth, ranks[i])
            out[i] = rates[d, r] * (1.0 if p < 0 else out[p])
        return out

    def observe(self, req_id: str, outcomes: list[tuple]) -> None:
        """``(depth, rank, accepted)`` or ``(depth, rank, accepted, source)``
        of nodes whose parent was accepted."""
        if not outcomes:
            return
        factor = self._decay ** len(outcomes)
        self.engine.decay(factor)
        for rates in self.sources.values():
            rates.decay(factor)
        req = self._table(self.requests, req_id)
        for depth, rank, ok, *rest in outcomes:
            d, r = self._bucket(depth, rank)
            tables = [self.engine, req]
            src = rest[0] if rest else None
            if src is not None:
                tables.append(self._table(self.sources, src))
                tables.append(self._table(self.request_sources.setdefault(req_id, {}), src))
            for rates in tables:
                rates.seen[d, r] += 1
                rates.acc[d, r] += ok

    def _table(self, tables: dict[str, _Rates], key: str) -> _Rates:
        """``tables[key]``, created empty on first use (not allocated on
        every lookup, as ``setdefault`` would: this runs per outcome)."""
        rates = tables.get(key)
        if rates is None:
            rates = tables[key] = _Rates.empty(self.max_depth, self.max_rank)
        return rates

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.request_sources.pop(req_id, None)


def _depth_of(tree: DraftTree, i: int) -> int:
    d = 0
    while i >= 0:
        d += 1
        i = tree.parents[i]
    return d


def sibling_ranks(tree: DraftTree) -> list[int]:
    """Rank of every node among its siblings: by score where the tree has
    scores (best first), else by the order the method laid them out (methods
    put their most likely child first)."""
    ranks = [0] * len(tree)
    for kids in tree.children():
        if tree.scores is not None:
            kids = sorted(kids, key=lambda c: -tree.scores[c])
        for r, c in enumerate(kids):
            ranks[c] = r
    return ranks


def shadow_outcomes(tree: DraftTree, truth) -> tuple[list[tuple], bool]:
    """Walk ``tree`` along ``truth`` (the tokens the target produced after
    the tree's root, as far as known). Returns the ``(depth, rank, accepted)``
    (plus the node's source where the tree names them) of every node whose
    parent was accepted and whose own outcome is known, and whether the walk
    is complete (nothing more can be learned later)."""
    children = tree.children()
    ranks = sibling_ranks(tree)
    sources = tree.sources
    out: list[tuple] = []
    cur, depth = -1, 0
    while children[cur + 1]:
        if depth >= len(truth):
            return out, False  # the next true token is not known yet
        nxt = None
        for c in children[cur + 1]:
            ok = tree.tokens[c] == int(truth[depth])
            out.append((depth + 1, ranks[c], ok) if sources is None
                       else (depth + 1, ranks[c], ok, sources[c]))
            if ok:
                nxt = c
        if nxt is None:
            break
        cur, depth = nxt, depth + 1
    return out, True


def subtree(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The nodes ``keep`` (a bool mask closed under parents), in tree order."""
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


@dataclass
class Choice:
    """What the controller chose for one step (for stats and tests)."""

    sizes: list[int]
    expected_accepted: list[float]
    expected_rate: float
    """Expected tokens per second of the chosen step (0 before any timing)."""
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
    closed_steps: int = 0
    """Steps that weighed accepted tokens as a closed batch's (nothing
    waiting for a slot; see ``BudgetController.token_values``)."""
    size_hist: dict[int, int] = field(default_factory=dict)


class DraftGate:
    """Whether the next step should draft at all (see the module docstring)."""

    def __init__(self, alpha: float = 0.2, max_skip: int = 32,
                 explore_share: float = 0.02, max_explore_skip: int = 512,
                 bound_after: int = 3) -> None:
        self.alpha = alpha
        self.max_skip = max_skip
        self.explore_share = explore_share
        """At most this share of a closed gate's time goes to exploring: a
        step that explores costs its drafting *and* the catch-up of what a
        head held meanwhile (tens of ms at batch 8 on a CPU), so exploring
        every ``max_skip`` steps alone could cost more than the 3 % a user
        notices."""
        self.max_explore_skip = max_explore_skip
        """Longest run of skipped steps the share allows (the estimates must
        not go stale for ever)."""
        self.bound_after = bound_after
        """Closings in a row (no whole batch's drafting paying in between)
        before ``explore_share`` stretches the skips; until then they are
        2, 4, ... steps."""
        self.explore_seconds: float | None = None
        """Proposer time of an exploring step, catch-up included (EMA)."""
        self.side_seconds: float | None = None
        """Drafting-only work the runner does outside the proposer, per step
        while drafting (slow EMA: it comes in bursts): the LM-head pass over
        new prompts that table-learning methods read (``recycle``,
        ``adapld``, ``graft``), about a fifth of a long prompt's prefill,
        which on long prompts can outweigh the extra tokens the drafts it
        feeds return."""
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
            # whole would keep the gate shut (a catch-up can cost several
            # times a whole step). A catch-up only makes the step look
            # dearer, so such a step may lower the estimate, never raise it:
            # a closed gate's drafting cost would otherwise stay what it was
            # when the gate closed, though drafting may have got cheaper
            # since (a head's cost-aware depth, for one).
            on, n, off = self.propose_seconds[True], self.drafting_requests, \
                self.propose_seconds[False] or 0.0
            if on is not None and n and requests > 0:
                equiv = off + (seconds - off) * n / requests  # at n requests
                if equiv < on:
                    self.propose_seconds[True] = ema(on, equiv, self.alpha)
            return
        self.propose_seconds[drafted] = ema(self.propose_seconds[drafted], seconds, self.alpha)
        if drafted:
            self.drafting_requests = ema(self.drafting_requests, requests, self.alpha)

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
        drafting, which for a model-free method is ~0.1 % of a step, while
        closing the gate on it skips the next 2-32 steps' drafts, paying ones
        included. A closed gate's exploring step is judged alone and, if it
        pays, restarts the average."""
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

    def reset_learning(self) -> None:
        """Forget everything the controller learned (acceptance estimates,
        calibration, the gate and its drafting costs, the step-cost curve);
        its counters stay. For a warm-up that must not teach: a warm-up on
        filler text (run so that first-use costs of new shapes do not land
        on the first real prompts) would teach the gate that drafting pays
        -- repetitive filler is drafted almost perfectly -- so the first
        real prompts would meet a proven, open gate instead of a cold
        engine's, and pay drafting-only side work before any evidence; and
        a warm-up that shares the CPU with another process measures steps
        far dearer than the real ones."""
        self._start()

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._expected.pop(req_id, None)
        self.acceptance.forget(req_id)

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
    def token_values(self, rows: int, remaining: list[int] | None,
                     length_bound: float = 1.0) -> np.ndarray | None:
        """Per request, what one of its accepted tokens is worth relative to
        a decoding request's share of a step (see the module docstring);
        None when every token is worth a share (``remaining`` None: an open
        workload, or the step cost not known yet). ``length_bound``: the
        share of recent requests that ran to their ``max_tokens``; the
        rest stopped earlier (end of sequence), where the tokens left say
        nothing of which request finishes last, so the closed-batch value
        is blended with 1 by it."""
        if (remaining is None or not remaining or rows <= 0 or not self.cost.known
                or not length_bound > 0):
            return None
        left = np.asarray(remaining, dtype=np.float64)
        step = self.cost(rows)
        if not step > 0:
            return None
        marginal = min(max(0.0, self.cost(rows + 1) - step), step / rows)
        fixed = step - rows * marginal
        longest = left >= left.max()
        value = (marginal + fixed * longest / longest.sum()) / (step / rows)
        return length_bound * value + (1.0 - length_bound)

    def choose(self, req_ids: list[str], trees: list[DraftTree | None],
               token_lens: list[int], rows: int,
               remaining: list[int] | None = None,
               length_bound: float = 1.0) -> tuple[list[DraftTree | None], Choice]:
        """Cut ``trees`` (one per request, None = no draft). ``token_lens``:
        each request's history length (where its tree's root sits);
        ``rows``: rows the next step verifies without any draft (one per
        decoding request); ``remaining``: tokens each request may still
        generate, in a closed batch (None: an open workload, every accepted
        token worth a request's share of a step); ``length_bound`` as in
        ``token_values``."""
        cand: list[tuple[float, int, int, int]] = []  # (-w * p, depth, request, node)
        probs: list[np.ndarray | None] = []
        values = self.token_values(rows, remaining, length_bound)
        self.stats.closed_steps += values is not None
        for j, (rid, tree) in enumerate(zip(req_ids, trees)):
            if tree is None or not len(tree):
                probs.append(None)
                continue
            self._pending.setdefault(rid, []).append((token_lens[j], tree))
            p = self.acceptance.node_probs(tree, rid)
            probs.append(p)
            depths = tree.depths()
            w = 1.0 if values is None else float(values[j])
            cand.extend((-w * float(p[i]), int(depths[i]), j, i) for i in range(len(tree)))
        # a child is never more likely than its parent and shares its
        # request's weight, so any prefix of this order is closed under parents
        cand.sort()
        cal = self.calibration
        keep = [np.zeros(len(t), dtype=bool) if t is not None else None for t in trees]
        # rows is 0 in a step of prompt chunks only (nothing to draft for)
        plain = rows / self.cost(rows) if self.cost.known and rows > 0 else 0.0
        best_k, best_rate, gain = 0, plain, float(rows)
        order: list[tuple[int, int]] = []
        for k, (neg_p, _, j, i) in enumerate(cand, 1):
            gain += -neg_p * cal
            order.append((j, i))
            if not self.cost.known:
                best_k = k  # no timing yet: verify everything, learn its cost
                continue
            rate = gain / self.cost(rows + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        for j, i in order[:best_k]:
            keep[j][i] = True
        if self.cost.known and rows > 0 and cand:
            # would this step's best cut have paid for the drafting as well?
            best_gain = rows + cal * sum(-c[0] for c in cand[:best_k])
            drafted = sum(1 for t in trees if t is not None and len(t))
            # seconds saved: plain decoding's time for the expected tokens
            # minus this step's time, drafting included (> 0 exactly when
            # the cut is not empty and its rate with the drafting beats
            # plain decoding's)
            surplus = (best_gain / plain - self.cost(rows + best_k)
                       - self.gate.draft_cost(drafted))
            self.gate.judge(step_seconds=self.cost(rows), whole_batch=drafted >= rows,
                            surplus=surplus)
        out: list[DraftTree | None] = []
        sizes, expected = [], []
        for j, (rid, tree) in enumerate(zip(req_ids, trees)):
            if tree is None or not keep[j].any():
                out.append(None)
                sizes.append(0)
                expected.append(0.0)
                continue
            # candidates are sorted by probability and a child is never more
            # likely than its parent (ties: shallower first), so the kept set
            # is closed under parents
            cut = subtree(tree, keep[j])
            model = float(probs[j][keep[j]].sum())
            exp = cal * model
            out.append(cut)
            sizes.append(len(cut))
            expected.append(exp)
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
        d["calibration"] = round(self.calibration, 3)
        d["acceptance_by_depth_rank"] = np.round(self.acceptance.rates(None), 3).tolist()
        # per source: the first level's best-ranked estimate and its evidence
        d["acceptance_by_source"] = {
            src: [round(float(self.acceptance.rates(None, src)[0, 0]), 3),
                  round(float(rates.seen.sum()), 1)]
            for src, rates in sorted(self.acceptance.sources.items())}
        return d
