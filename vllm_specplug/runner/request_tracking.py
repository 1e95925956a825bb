"""Which requests the method sees: vLLM's request-state updates mirrored
to the method (added, removed, preempted, resumed), requests that opted
out of speculation and those that stopped drafting after repeated faults."""

from __future__ import annotations

from vllm_specplug.request_flags import speculates
from vllm_specplug.runner.guard import guard_for


class RequestTrackingMixin:
    """The method's view of vLLM's requests (see module doc)."""

    def _update_states(self, scheduler_output):
        prop = self._sp_proposer
        preempted = set(scheduler_output.preempted_req_ids or ())
        self._sp_stats.preempted += len(preempted)
        gone = set(scheduler_output.finished_req_ids) | preempted
        guard = guard_for(self) if prop is not None else None
        for rid in gone:
            self._sp_requests.trees.pop(rid, None)
            self._sp_budget.forget(rid)
            if prop is not None and not self._sp_unseen(rid):
                # a finished request's fault adds to no streak: it is gone
                guard.call("remove_request", lambda rid=rid: prop.remove_request(rid),
                           None if rid in scheduler_output.finished_req_ids else rid)
        for rid in scheduler_output.finished_req_ids:
            self._sp_requests.opted_out.discard(rid)
            if guard is not None:
                guard.forget(rid)
        for rid in [n.req_id for n in scheduler_output.scheduled_new_reqs
                    if n.req_id in self.requests]:
            # a streaming-input session's next chunk comes back under its id:
            # the method state of the chunk before goes first (this chunk
            # may opt out of speculation, and would leave it behind)
            self._sp_requests.drop(rid)
            if prop is not None and not self._sp_unseen(rid):
                guard.call("remove_request", lambda rid=rid: prop.remove_request(rid), rid)
            self._sp_requests.opted_out.discard(rid)
        out = super()._update_states(scheduler_output)
        if prop is not None:
            for new in scheduler_output.scheduled_new_reqs:
                rid = new.req_id
                if not speculates(new.sampling_params.extra_args
                                  if new.sampling_params is not None else None):
                    self._sp_requests.opted_out.add(rid)
                    continue
                guard.call("add_request", lambda rid=rid: prop.add_request(rid), rid)
            for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
                if self._sp_unseen(rid):
                    continue
                guard.call("remove_request", lambda rid=rid: prop.remove_request(rid), rid)
                if rid not in guard.stopped:
                    guard.call("add_request", lambda rid=rid: prop.add_request(rid), rid)
            self._sp_stop_drafting(guard.take_stopped())
        return out

    def _sp_unseen(self, rid: str) -> bool:
        """The method does not see this request: it opted out of speculation,
        or stopped drafting after repeated faults (runner/guard.py)."""
        guard = getattr(self, "_sp_guard", None)
        return rid in self._sp_requests.opted_out or (guard is not None and rid in guard.stopped)

    def _sp_stop_drafting(self, req_ids: list[str]) -> None:
        """Requests that just stopped drafting for good: drop their trees and
        free their method state (once; they are unseen from now on)."""
        prop, guard = self._sp_proposer, guard_for(self)
        for rid in req_ids:
            self._sp_requests.drop(rid)
            guard.call("remove_request", lambda rid=rid: prop.remove_request(rid))

    def _sp_silent_rows(self) -> set[int]:
        """Batch rows of the ``_sp_silent`` requests: no top-k or entropy
        is computed for them."""
        silent = self._sp_silent()
        if not silent:
            return set()
        return {i for i, rid in enumerate(self.input_batch.req_ids) if rid in silent}

    def _sp_silent(self) -> set[str]:
        """Requests that get no drafting work at all this step (no draft
        budget, no LM-head side work, no hidden-state rows): the opted out,
        and on a single rank those that stopped drafting. Under tensor
        parallelism a stop is this rank's own (its method faulted), while
        budgets and the LM-head passes (a collective) must match on every
        rank: there such a request only stops reaching the method, and is
        verified with rank 0's tree."""
        silent = set(self._sp_requests.opted_out)
        guard = getattr(self, "_sp_guard", None)
        if guard is not None and self.parallel_config.tensor_parallel_size == 1:
            silent |= guard.stopped
        return silent
