"""The runner's safety net around a method's ``propose``.

A proposer that raises (or returns something unusable) must never take the
server down: speculation is optional, plain decoding is always correct. So
the runner calls the method through :class:`ProposeGuard`:

- ``propose(batch)`` raises: each request is retried alone, and the ones
  that fail again get no draft this step and their method state is reset
  (``remove_request`` + ``add_request``), so a corrupted state cannot
  outlive the fault; the other requests keep their trees.
- a tree with tokens outside the vocabulary, or the wrong number of trees:
  the affected requests get no draft.
- the first fault is logged with its traceback, later ones are only counted
  (``propose_faults`` = faulty steps, ``fault_requests`` = requests that fell
  back); the counters reach ``specplug_stats`` and the server's ``/metrics``.
- the method's other hooks (``add_request``, ``remove_request``,
  ``catch_up_rows``, ``stats``) run through ``call``: a fault there is
  counted (``hook_faults``) and the request goes on decoding.
- a request whose hooks fail ``max_request_faults`` times in a row stops
  drafting until it finishes (``requests_stopped_drafting``): the runner
  keeps it away from the method, as a request that opted out of speculation
  (``request_flags.SPECULATE``), instead of paying a failing call every step.

Under tensor parallelism every rank runs its own proposer on the same
inputs, and all ranks must verify the same trees (the attention mask and
positions of a step are part of the sharded forward pass). Rank 0's trees are
broadcast to the others, so a rank whose method diverged (a fault on one
rank only, a vocabulary-sharded embedding table, a non-deterministic index)
still verifies what rank 0 verifies; ``rank_divergences`` counts the steps
where a rank's own trees differed.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

from vllm_specplug.engine.tree import DraftTree

logger = logging.getLogger("vllm_specplug.runner")

T = TypeVar("T")


class ProposeGuard:
    def __init__(self, vocab_size: int, stats, publish=None, tp_group=None,
                 max_request_faults: int = 0, method: str = "?") -> None:
        self.vocab_size = vocab_size
        self.stats = stats
        """The runner's ``TreeStats``: the fault counters live there."""
        self.publish = publish
        """Optional ``callable(dict, force=)`` told the counters after each call
        (tests; the runner sends its counters to /metrics itself,
        ``metrics.WorkerCounters``)."""
        self.tp_group = tp_group
        """vLLM's tensor-parallel group coordinator (None: one rank)."""
        self.max_request_faults = max_request_faults
        """Faults in a row after which a request stops drafting (0: never;
        ``MethodConfig.max_request_faults``)."""
        self.method = method
        self.streaks: dict[str, int] = {}
        """Request -> faults in a row (only requests whose last hook call failed)."""
        self.stopped: set[str] = set()
        """Requests that stopped drafting for good (until they finish)."""
        self._newly_stopped: list[str] = []
        self._logged = False
        self._logged_hooks: set[str] = set()

    def counters(self) -> dict[str, int]:
        s = self.stats
        return {"propose_faults": s.propose_faults, "fault_requests": s.fault_requests,
                "rank_divergences": s.rank_divergences, "hook_faults": s.hook_faults,
                "requests_stopped_drafting": s.requests_stopped_drafting}

    def call(self, hook: str, fn: Callable[[], T], req_id: str | None = None,
             default: T | None = None) -> T | None:
        """``fn()``, a call of the method's hook ``hook``; if it raises,
        ``default``: the fault is counted (``hook_faults``), logged once per
        hook with its traceback, and counts towards ``req_id``'s streak."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any method bug must fall back
            self.stats.hook_faults += 1
            if hook not in self._logged_hooks:
                self._logged_hooks.add(hook)
                logger.error(
                    "specplug: method '%s' failed in %s (%s: %s) for request %s; the "
                    "request goes on decoding. Further faults there are only counted "
                    "(specplug:hook_faults on /metrics).", self.method, hook,
                    type(e).__name__, e, req_id, exc_info=e)
            if req_id is not None:
                self._fault(req_id)
            if self.publish is not None:
                self.publish(self.counters(), force=True)
            return default

    def _fault(self, req_id: str) -> None:
        """One more fault in a row for ``req_id``; at ``max_request_faults``
        the request stops drafting (``take_stopped``)."""
        n = self.streaks[req_id] = self.streaks.get(req_id, 0) + 1
        if (self.max_request_faults and n >= self.max_request_faults
                and req_id not in self.stopped):
            self.stopped.add(req_id)
            self._newly_stopped.append(req_id)
            if not self.stats.requests_stopped_drafting:
                logger.warning(
                    "specplug: request %s stopped drafting after %d faults in a row "
                    "(max_request_faults); it decodes plainly until it finishes. Further "
                    "ones are only counted (specplug:requests_stopped_drafting on /metrics).",
                    req_id, n)
            self.stats.requests_stopped_drafting += 1

    def take_stopped(self) -> list[str]:
        """Requests that stopped drafting since the last call: the runner
        keeps them away from the method from now on and frees their state."""
        out, self._newly_stopped = self._newly_stopped, []
        return out

    def forget(self, req_id: str) -> None:
        """The request finished: drop its streak and stopped mark."""
        self.streaks.pop(req_id, None)
        self.stopped.discard(req_id)
        if req_id in self._newly_stopped:
            self._newly_stopped.remove(req_id)

    def propose(self, proposer, batch: list, skip=frozenset()) -> list[DraftTree | None]:
        """One tree (or None) per request of ``batch``; requests in ``skip``
        are not shown to the method and get None (before the tensor-parallel
        exchange, which then gives them rank 0's tree)."""
        active = [i for i, r in enumerate(batch) if r.req_id not in skip]
        trees: list[DraftTree | None] = [None] * len(batch)
        faulted = False
        if active:
            mine, faulted = self._propose(proposer, [batch[i] for i in active])
            for i, tree in zip(active, mine):
                trees[i] = tree
        trees = self._same_on_every_rank(trees)
        if self.publish is not None:
            self.publish(self.counters(), force=faulted)
        return trees

    def _propose(self, proposer, batch: list) -> tuple[list[DraftTree | None], bool]:
        """The method's trees for ``batch`` and whether anything failed."""
        faulty: set[int] = set()
        raised = False
        try:
            trees = list(proposer.propose(batch))
            if len(trees) != len(batch):
                raise RuntimeError(f"propose returned {len(trees)} trees for "
                                   f"{len(batch)} requests")
        except Exception as e:  # noqa: BLE001 - any method bug must fall back
            self._log(e, proposer, [r.req_id for r in batch])
            raised = True
            trees = []
            for i, req in enumerate(batch):
                try:
                    trees.append(proposer.propose([req])[0])
                except Exception:  # noqa: BLE001
                    faulty.add(i)
                    trees.append(None)
                    self._reset(proposer, req.req_id)
        for i, tree in enumerate(trees):
            if tree is not None and not self._valid(tree):
                self._log(ValueError("not a DraftTree, or a token outside the "
                                     "vocabulary"), proposer, [batch[i].req_id])
                faulty.add(i)
                trees[i] = None
        if faulty or raised:  # a batch that raised counts even if every retry worked
            self.stats.propose_faults += 1
            self.stats.fault_requests += len(faulty)
        for i, req in enumerate(batch):
            if i in faulty:
                self._fault(req.req_id)
            else:
                self.streaks.pop(req.req_id, None)
        return trees, bool(faulty or raised)

    def _valid(self, tree) -> bool:
        try:
            if not isinstance(tree, DraftTree):
                return False
            return all(0 <= int(t) < self.vocab_size for t in tree.tokens)
        except Exception:  # noqa: BLE001
            return False

    def _same_on_every_rank(self, trees: list) -> list:
        g = self.tp_group
        if g is None or g.world_size <= 1:
            return trees
        mine = [None if t is None else (list(t.tokens), list(t.parents)) for t in trees]
        ref = g.broadcast_object(mine, src=0)
        if ref == mine:
            return trees  # keep the method's own objects (and their extra fields)
        self.stats.rank_divergences += 1
        return [t if r == m else (None if r is None else DraftTree(*r))
                for t, r, m in zip(trees, ref, mine)]

    def _log(self, err: Exception, proposer, req_ids: list[str]) -> None:
        if self._logged:
            return
        self._logged = True
        logger.error(
            "specplug: method '%s' failed in propose (%s: %s) for requests %s; "
            "those requests decode without speculation this step. Further faults "
            "are only counted (specplug:propose_faults on /metrics).",
            getattr(proposer, "name", "?"), type(err).__name__, err, req_ids[:8],
            exc_info=err)

    def _reset(self, proposer, req_id: str) -> None:
        """Drop and recreate a request's method state after a fault, so a
        corrupted state cannot outlive it (faults here are counted, not
        added to the streak: the propose fault already was)."""
        self.call("remove_request", lambda: proposer.remove_request(req_id))
        self.call("add_request", lambda: proposer.add_request(req_id))


def guard_for(runner) -> ProposeGuard:
    """The runner's guard, built on first use (the TP group is only known
    once the worker is up)."""
    guard = getattr(runner, "_sp_guard", None)
    if guard is None:
        guard = runner._sp_guard = ProposeGuard(
            runner.model_config.get_vocab_size(), runner._sp_stats, None, tp_group_or_none(),
            max_request_faults=getattr(getattr(runner._sp_proposer, "config", None),
                                       "max_request_faults", 0),
            method=runner._sp_method)
    return guard


def tp_group_or_none() -> Any:
    """vLLM's TP group when tensor parallelism is on, else None."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
    except Exception:  # noqa: BLE001 - not initialised (unit tests)
        return None
    return g if g.world_size > 1 else None
