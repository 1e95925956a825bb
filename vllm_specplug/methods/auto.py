"""`auto`: every source the engine has, weighed per request.

Each step, each request's tree is drafted from several sources at once:

* ``copy<n>``: the continuations of the context's longest suffix match in
  the request's own tokens (prompt lookup; ``n`` the match length, capped
  at 4), claimed by ``sources/copy_path.py``'s prior for that length;
* ``suffix``: the suffix trees over the request and over earlier responses
  of its tenant (SuffixDecoding, ``sources/suffix_cache.py``; ``isolation``
  decides whose), claimed by their count shares;
* ``datastore``: the path a suffix-array datastore continues the context
  with, where one is configured (READER's search over its long-term
  store, ``sources/sa_datastore.py``), claimed by each token's share of
  the counts that followed its key;
* ``head``: the EAGLE-3 head's tree where the target has a head
  (``sources/eagle3_drafter.py``), claimed by its probabilities.

``sources/source_mix.py`` learns, per source and per request, how far the
claims hold (from what the target then produced), merges the trees on that
one scale and keeps the likeliest ``num_speculative_tokens`` nodes; the
engine's cost-aware budget then cuts the tree to what pays this step, as
for every method. Which source paid shows per source in the method's stats
and on ``/metrics`` (the runner counts accepted tokens by node name).

The head is the one source with a cost of its own (a head pass per depth,
and feeding it the verified rows). The cheap sources draft first, and a
request asks for the head while what it adds pays at this step's *cover*
(how many accepted tokens the cheap sources' tree is expected to give,
in levels, ``COVER_LEVELS``): the head's accepted nodes per head step at
that level (only those no cheaper source also drafted, which keep the
cheaper source's name) times ``token_seconds`` against the head's measured
time per request, shrunk toward all requests' at that level while a
request has little evidence; a request that stops asking at a level tries
again every ``head_explore_every`` steps there. Beside a long confident
copy the head adds little; where nothing else drafts it adds most. A
request that does not ask holds its verified rows, its prompt too until it
first asks, fed to the head in one batched pass when it next asks; what a
request must feed counts in the cost of asking, spread over
``head_feed_steps`` steps, so a long prompt whose head drafts would not
pay for its feed is never fed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal

import numpy as np
from pydantic import Field

from vllm_specplug.config import SpecplugConfigError, missing_option
from vllm_specplug.engine.interface import (
    Needs,
    Proposer,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.stats import cost_ema
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources import suffix_cache
from vllm_specplug.sources.copy_path import CopyConfidence
from vllm_specplug.sources.eagle3_drafter import Eagle3Drafter, Eagle3DrafterConfig
from vllm_specplug.sources.ngram import match
from vllm_specplug.sources.sa_datastore import SuffixArrayStoreOptions, path_tree, search_path
from vllm_specplug.sources.source_mix import SourceMix
from vllm_specplug.sources.suffix_cache import TenantSuffixCaches

logger = logging.getLogger(__name__)


class AutoConfig(Eagle3DrafterConfig, SuffixArrayStoreOptions):
    """The EAGLE-3 head's options (the head source), the datastore's
    (``datastore``: the datastore source, off without one) and the other
    sources'."""

    use_head: Literal["auto", "always", "never"] = "auto"
    """The EAGLE-3 head as a source: ``auto`` where the target has a head
    (``head``, or one shipped for its shape), asked per request while it
    pays; ``always`` asks it for every request and fails at start-up
    without a head; ``never`` drafts from the model-free sources only."""
    head_explore_every: int = Field(default=8, ge=1)
    """A request that stopped asking the head (it did not pay) asks again
    after this many steps, to see whether it pays now."""
    head_feed_steps: int = Field(default=16, ge=0)
    """The rows a request must feed the head before it drafts (its prompt
    at first, the rows of the steps it did not ask after) count in the
    cost of asking, spread over this many steps (the state they build
    serves later steps too). A request holds its prompt until it first
    asks, so one whose prompt costs more than the head adds never feeds
    it. 0: feeding is not counted and prompts are fed as they come."""
    prompt_lookup_max: int = Field(default=4, ge=1, le=64)
    """Longest context suffix (tokens) the copy source matches."""
    copy_branches: int = Field(default=2, ge=1, le=16)
    """Continuations of the match (distinct first tokens) the copy source
    drafts."""
    suffix: bool = True
    """Draft from suffix trees (needs the ``arctic-inference`` package;
    without it the source is off and a warning says so)."""
    max_tree_depth: int = Field(default=24, ge=1, le=1024)
    """The suffix trees' depth: longest match and deepest suffix draft."""
    max_cached_requests: int = Field(default=10000, ge=0)
    """Earlier responses the suffix trees keep, all tenants together
    (0: each request's own tokens only)."""
    max_cached_tokens: int | None = Field(default=1 << 22, ge=0)
    """Response tokens the suffix trees keep, all tenants together (about
    350 bytes of host memory each); None: bounded by
    ``max_cached_requests`` alone."""
    max_tenants: int = Field(default=64, ge=1)
    """Tenants that keep suffix trees of earlier responses (LRU)."""
    min_token_prob: float = Field(default=0.1, ge=0.0, le=1.0)
    """Suffix nodes whose count share along their path is below this are
    not drafted."""
    datastore_depth: int = Field(default=8, ge=1, le=64)
    """Longest path the datastore source drafts (a datastore lookup per
    token)."""
    datastore_key: int = Field(default=6, ge=1, le=32)
    """Longest context suffix (tokens) the datastore is searched with; a
    key it does not hold loses its first token and is retried."""


class AutoProposer(Proposer):
    name = "auto"
    config_cls = AutoConfig
    remembers_outputs = True  # the suffix trees of earlier responses
    tenant_aware = True  # kept per tenant; the head's prefix store too

    def __init__(self, config: AutoConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        self.head = _open_head(config, ctx)
        self.suffix = None
        if config.suffix and suffix_cache.available():
            self.suffix = TenantSuffixCaches(config.max_tree_depth, config.max_cached_requests,
                                             config.max_tenants, config.max_cached_tokens)
        elif config.suffix:
            logger.warning("specplug auto: the suffix source is off (arctic-inference "
                           "is not installed)")
        self.store = config.open_datastore(ctx.vocab_size, ctx.tokenizer_path)
        self.copy = CopyConfidence()
        self.mix = SourceMix()
        self.head_use = _HeadUse(config.head_explore_every,
                                 feed_steps=config.head_feed_steps)
        self._counts: dict[str, int] = {}
        self._asked_head: dict[str, int] = {}  # request -> its cover, where the head drafted

    def needs(self) -> Needs:
        return self.head.needs() if self.head is not None else Needs()

    def add_request(self, req_id: str) -> None:
        if self.head is not None:
            self.head.add_request(req_id)
        if self.suffix is not None:
            self.suffix.stop(req_id)  # a request seen again is fed from its prompt

    def remove_request(self, req_id: str) -> None:
        if self.head is not None:
            self.head.remove_request(req_id)
        if self.suffix is not None:
            self.suffix.stop(req_id)
        self.mix.remove_request(req_id)
        self.head_use.remove_request(req_id)
        self._asked_head.pop(req_id, None)

    def catch_up_rows(self, req_id: str, new_rows: int) -> int:
        return self.head.catch_up_rows(req_id, new_rows) if self.head is not None else 0

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        # a step no request drafts in (the gate closed) feeds the suffix
        # trees later, when one does: nothing reads them meanwhile
        drafting = any(r.sampled and r.budget > 0 for r in batch)
        for r in batch:
            if r.sampled:
                self._learn(r, drafting)
        # the cheap sources first: whether the head is asked depends on them
        lookups: list[list[tuple[str, DraftTree]]] = [[] for _ in batch]
        for i in self.deadline.order(batch):
            r = batch[i]
            if r.sampled and r.budget > 0 and self.deadline.allows(r.req_id):
                lookups[i] = self._lookups(r)
        heads = self._head_trees(batch, lookups, drafting)
        out: list[DraftTree | None] = [None] * len(batch)
        for i, r in enumerate(batch):
            if not r.sampled or r.budget <= 0:
                continue
            # cheapest source first: a node several drafted is named after it
            drafts = lookups[i] + ([("head", heads[i])] if heads[i] is not None else [])
            tree = self.mix.merge(r.req_id, drafts, r.budget, len(r.token_ids),
                                  chain=r.chain_only)
            out[i] = tree
            self._count("trees", tree is not None)
        return out

    def _learn(self, r: StepRequest, feed_suffix: bool = True) -> None:
        """The request's last tree judged, the head's value updated; the
        suffix trees fed (``feed_suffix``) or the request's new tokens held
        for them."""
        judged = self.mix.observe(r.req_id, r.token_ids)
        for source, j in judged.items():
            self._count(f"{source}_accepted", j.accepted)
            self._count(f"{source}_added", j.added)
        cover = self._asked_head.get(r.req_id)
        if cover is not None and judged:
            # the head pays for what no cheaper source also drafted
            head = judged.get("head")
            self.head_use.observe(r.req_id, head.added if head is not None else 0, cover)
        if self.suffix is not None:
            feed = self.suffix.sync if feed_suffix else self.suffix.hold
            feed(r.req_id, r.tenant, r.token_ids, r.num_prompt_tokens)

    def _head_trees(self, batch: list[StepRequest], lookups: list[list[tuple[str, DraftTree]]],
                    drafting: bool) -> list[DraftTree | None]:
        """The head's trees (claims: probabilities) for the requests that
        ask it this step, judged against what the cheap sources already
        drafted for each (``lookups``); every request's verified rows feed
        (or are held for) the head's state. ``drafting``: some request
        drafts this step."""
        if self.head is None:
            return [None] * len(batch)
        always = self.config.use_head == "always"
        counted = self.config.head_feed_steps > 0
        if not drafting:
            # the gate closed: every request holds its rows, nothing to weigh
            self._feed_head(batch, [False] * len(batch), counted)
            self._asked_head = {}
            return [None] * len(batch)
        # a request that drafts nothing this step needs no cover level
        covers = [cover_of(self.mix.expected(r.req_id, found, r.budget))
                  if r.sampled and r.budget > 0 else 0 for r, found in zip(batch, lookups)]
        # rows the head must take in before it drafts for the request
        pending = [self.head.catch_up_rows(r.req_id, _rows(r)) if counted else 0 for r in batch]
        asks = [r.sampled and r.budget > 0 and (always or self.head_use.asks(r, c, p))
                for r, c, p in zip(batch, covers, pending)]
        t0 = time.perf_counter()
        fed = self._feed_head(batch, asks, counted)
        t1 = time.perf_counter()
        # a step no request asks the head in costs no draft call
        trees = (self.head.draft(fed, [r.budget if a else 0 for r, a in zip(fed, asks)])
                 if any(asks) else [None] * len(batch))
        # uncounted, feeding is part of asking's cost
        self.head_use.cost(time.perf_counter() - (t1 if counted else t0), sum(asks))
        self._asked_head = {r.req_id: c for r, a, c in zip(batch, asks, covers) if a}
        for c in range(len(COVER_LEVELS) + 1):
            self._count(f"head_asked_cover{c}", sum(a and k == c for a, k in zip(asks, covers)))
        self._count("head_asked", sum(asks))
        self._count("head_skipped", sum(r.sampled and r.budget > 0 for r in batch) - sum(asks))
        return [None if t is None else _probabilities(t) for t in trees]

    def _feed_head(self, batch: list[StepRequest], asks: list[bool],
                   counted: bool) -> list[StepRequest]:
        """Every request's verified rows to the head, and the requests as the
        head saw them: one that does not ask holds its rows (budget 0; a
        prompt chunk: not drafting) and feeds them in one pass when it next
        asks; with feeding ``counted``, its time per row is measured."""
        fed = [r if ask or (not r.sampled and not counted) else _holding(r)
               for r, ask in zip(batch, asks)]
        rows_before = self.head.runtime.stats.extended_rows
        t0 = time.perf_counter()
        self.head.extend(fed)
        if counted:
            self.head_use.feed(time.perf_counter() - t0,
                               self.head.runtime.stats.extended_rows - rows_before)
        return fed

    def _lookups(self, r: StepRequest) -> list[tuple[str, DraftTree]]:
        """The model-free sources' trees for ``r``."""
        cfg: AutoConfig = self.config
        out = []
        n, begins = match(r.token_ids, 1, cfg.prompt_lookup_max,
                          1 if r.chain_only else cfg.copy_branches)
        if begins:
            out.append((f"copy{min(n, 4)}", self._copy_tree(r.token_ids, n, begins, r.budget)))
        if self.suffix is not None:
            tree = self.suffix.draft(r.req_id, r.token_ids, r.budget,
                                     tree=not r.chain_only, min_token_prob=cfg.min_token_prob)
            if tree is not None:
                out.append(("suffix", tree))
        if self.store is not None:
            path, shares = search_path(r.token_ids, min(cfg.datastore_depth, r.budget),
                                       cfg.datastore_key, None, self.store,
                                       max_rows=cfg.max_lookup_rows)
            if path:
                out.append(("datastore", path_tree(path, shares)))
        for source, _ in out:
            self._count(f"{source}_drafts", 1)
        return out

    def _copy_tree(self, tokens: np.ndarray, n: int, begins: list[int],
                   budget: int) -> DraftTree:
        """Each continuation as a path under the root, claimed by the copy
        prior for a match of ``n`` tokens (later continuations at half)."""
        out_tokens, parents, scores = [], [], []
        for k, b in enumerate(begins):
            cont = tokens[b:b + budget].tolist()
            claims = self.copy.scores(n, len(cont), scale=0.5 ** k)
            for j, (tok, claim) in enumerate(zip(cont, claims)):
                parents.append(-1 if j == 0 else len(out_tokens) - 1)
                out_tokens.append(int(tok))
                scores.append(claim)
        return DraftTree(out_tokens, parents, scores=scores)

    def _count(self, key: str, n: int | bool) -> None:
        self._counts[key] = self._counts.get(key, 0) + int(n)

    def stats(self) -> ProposerStats:
        """Drafts and accepted nodes per source, head asks and skips, and
        each source's calibration factor over all requests."""
        s = ProposerStats(counters=dict(self._counts))
        if self.head is not None:
            h = self.head.stats()
            s.counters.update({f"head_{k}": v for k, v in h.counters.items()})
            s.gauges.update({f"head_{k}": v for k, v in h.gauges.items()})
        if self.suffix is not None:
            s.gauges["suffix_cached_responses"] = self.suffix.cached
            s.gauges["suffix_cached_tokens"] = self.suffix.cached_tokens
        if self.store is not None:
            s.gauges["datastore_tokens"] = len(self.store)
        s.counters["deadline_skips"] = self.deadline.skipped
        s.gauges["factors"] = {k: round(self.mix.factor("", k), 3) for k in self.mix.sources}
        return s


def _open_head(config: AutoConfig, ctx: ProposerContext) -> Eagle3Drafter | None:
    """The head source, or None: ``use_head`` never, or auto without a head."""
    from vllm_specplug.eagle3 import default_head_for

    if config.use_head == "never":
        return None
    if config.head is None and default_head_for(ctx.model_path) is None:
        if config.use_head == "always":
            raise missing_option("head", "auto", f"use_head is 'always' and specplug ships "
                                                 f"no EAGLE-3 head for {ctx.model_path}")
        return None
    if ctx.embed_tokens is None:
        if config.use_head == "always":
            raise SpecplugConfigError("method 'auto' with use_head 'always' needs the "
                                      "target's input embeddings, which this model does "
                                      "not expose")
        return None
    return Eagle3Drafter(config, ctx)


def _holding(r: StepRequest) -> StepRequest:
    """``r`` as the head sees a request that does not ask it: it holds the
    rows (no budget; a prompt chunk not drafting). Already so in a step
    the gate closed, where copying every request would be the step's cost."""
    if r.sampled:
        return r if r.budget <= 0 else dataclasses.replace(r, budget=0)
    return r if not r.drafting else dataclasses.replace(r, drafting=False)


def _rows(r: StepRequest) -> int:
    """Target rows this step brings for the head (its verified tokens')."""
    return 0 if r.aux_hidden is None else int(r.aux_hidden.shape[0])


def _probabilities(tree: DraftTree) -> DraftTree:
    """A head tree with its cumulative log-probabilities as probabilities."""
    scores = None if tree.scores is None else [float(np.exp(s)) for s in tree.scores]
    if scores is None:
        scores = [0.5] * len(tree)
    return DraftTree(tree.tokens, tree.parents, scores=scores, sources=None)


COST_RISE = 2.0
"""A head call dearer than its estimate counts at most this many times it."""


COVER_LEVELS = (0.5, 2.0)
"""Accepted tokens the cheap sources' own tree is expected to give, at
which a step's cover rises a level: the head's worth is learned per level,
since what it adds beside a long confident copy is not what it adds where
nothing else drafts."""


def cover_of(expected: float) -> int:
    """The cover level (0 .. len(COVER_LEVELS)) of a step whose cheap
    sources are expected to give ``expected`` accepted tokens."""
    return sum(expected >= level for level in COVER_LEVELS)


class _HeadUse:
    """Whether a request asks the head this step: while the head's extra
    accepted nodes per head step at this step's cover level, times what an
    accepted token saves, exceed what the head costs a request (see the
    module docstring)."""

    def __init__(self, explore_every: int, weight: float = 4.0, decay: float = 0.9,
                 feed_steps: int = 16) -> None:
        self.explore_every = explore_every
        self.feed_steps = feed_steps
        """Steps a feed's cost is spread over (``head_feed_steps``)."""
        self.weight = weight
        """Head steps after which a request's own record weighs as much as
        all requests'."""
        self.decay = decay
        levels = len(COVER_LEVELS) + 1
        self.gain = [[0.0, 0.0] for _ in range(levels)]
        """Per cover level, all requests: decayed (accepted, head steps)."""
        self.requests: dict[str, list[list[float]]] = {}
        """Per request, per cover level: accepted, head steps, steps since asked."""
        self.seconds: float | None = None
        """The head's seconds per request asking (see ``cost``)."""
        self.row_seconds: float | None = None
        """The head's seconds per row fed (see ``feed``)."""

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def _mine(self, req_id: str, cover: int) -> list[float]:
        levels = self.requests.setdefault(
            req_id, [[0.0, 0.0, 0] for _ in range(len(COVER_LEVELS) + 1)])
        return levels[cover]

    def observe(self, req_id: str, accepted: int, cover: int = 0) -> None:
        """``accepted``: nodes the head added to the request's last tree
        that the target produced; ``cover``: that step's cover level."""
        mine = self._mine(req_id, cover)
        mine[0], mine[1] = mine[0] * self.decay + accepted, mine[1] * self.decay + 1
        gain = self.gain[cover]
        gain[0] = gain[0] * 0.999 + accepted
        gain[1] = gain[1] * 0.999 + 1

    def cost(self, seconds: float, asked: int) -> None:
        """A head call's time for ``asked`` requests. Contention only ever
        adds time (another process on the cores, a new shape's first
        kernels), so a cheaper call than the estimate is trusted at once
        (half-way) and a dearer one slowly, at most ``COST_RISE`` times the
        estimate: otherwise one slow call prices the head out of every
        request for a hundred steps, and a head that is not asked is
        rarely measured again to correct it."""
        if asked:
            self.seconds = cost_ema(self.seconds, seconds / asked, 0.1, COST_RISE)

    def feed(self, seconds: float, rows: int) -> None:
        """A call's time feeding ``rows`` rows to the head (as ``cost``)."""
        if rows:
            self.row_seconds = cost_ema(self.row_seconds, seconds / rows, 0.1, COST_RISE)

    def asks(self, r: StepRequest, cover: int = 0, pending: int = 0) -> bool:
        """``pending``: rows the request must feed the head before it drafts."""
        mine = self._mine(r.req_id, cover)
        if r.token_seconds <= 0 or self.seconds is None:
            return True  # nothing measured yet: the head's value is unknown
        feed = (self.row_seconds or 0.0) * pending
        gain = self.gain[cover]
        prior = (gain[0] + 0.5) / (gain[1] + 1.0)
        per_step = (mine[0] + prior * self.weight) / (mine[1] + self.weight)
        if per_step * r.token_seconds >= self.seconds + feed / max(self.feed_steps, 1):
            mine[2] = 0
            return True
        mine[2] += 1
        # exploring spends at most what the steps not asked saved
        if mine[2] >= self.explore_every and feed <= self.seconds * mine[2]:
            mine[2] = 0
            return True
        return False
