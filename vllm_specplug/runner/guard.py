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
from typing import Any

from vllm_specplug.engine.tree import DraftTree

logger = logging.getLogger("vllm_specplug.runner")


class ProposeGuard:
    def __init__(self, vocab_size: int, stats, publish=None, tp_group=None) -> None:
        self.vocab_size = vocab_size
        self.stats = stats
        """The runner's ``TreeStats``: the fault counters live there."""
        self.publish = publish
        """``callable(dict, force=)`` exporting the counters (``metrics.WorkerStatsFile``)."""
        self.tp_group = tp_group
        """vLLM's tensor-parallel group coordinator (None: one rank)."""
        self._logged = False

    def counters(self) -> dict[str, int]:
        s = self.stats
        return {"propose_faults": s.propose_faults, "fault_requests": s.fault_requests,
                "rank_divergences": s.rank_divergences}

    def propose(self, proposer, batch: list) -> list[DraftTree | None]:
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
                    _reset(proposer, req.req_id)
        for i, tree in enumerate(trees):
            if tree is not None and not self._valid(tree):
                self._log(ValueError("not a DraftTree, or a token outside the "
                                     "vocabulary"), proposer, [batch[i].req_id])
                faulty.add(i)
                trees[i] = None
        if faulty or raised:  # a batch that raised counts even if every retry worked
            self.stats.propose_faults += 1
            self.stats.fault_requests += len(faulty)
        trees = self._same_on_every_rank(trees)
        if self.publish is not None:
            self.publish(self.counters(), force=bool(faulty or raised))
        return trees

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


def _reset(proposer, req_id: str) -> None:
    for fn in (proposer.remove_request, proposer.add_request):
        try:
            fn(req_id)
        except Exception:  # noqa: BLE001 - the request still decodes plainly
            pass


def guard_for(runner) -> ProposeGuard:
    """The runner's guard, built on first use (rank, instance id and TP group
    are only known once the worker is up)."""
    guard = getattr(runner, "_sp_guard", None)
    if guard is None:
        import os

        from vllm_specplug.metrics import STATS_ID_ENV, WorkerStatsFile

        tp = tp_group_or_none()
        rank = 0 if tp is None else tp.rank_in_group
        publish = WorkerStatsFile(os.environ.get(STATS_ID_ENV, "none"), rank)
        guard = runner._sp_guard = ProposeGuard(
            runner.model_config.get_vocab_size(), runner._sp_stats, publish, tp)
    return guard


def tp_group_or_none() -> Any:
    """vLLM's TP group when tensor parallelism is on, else None."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
    except Exception:  # noqa: BLE001 - not initialised (unit tests)
        return None
    return g if g.world_size > 1 else None
