"""vLLM's side of the runner's ``_update_states``, for tests of the mixin
without an engine."""

from __future__ import annotations

from types import SimpleNamespace


class FakeVllmRunner:
    """Tracks requests as vLLM's runner does: a new request whose id it
    tracks already (a streaming session's next chunk) is updated in place."""

    def _update_states(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(sampling_params=new.sampling_params)
        for rid in scheduler_output.finished_req_ids:
            self.requests.pop(rid, None)
        self.input_batch.req_ids = list(self.requests)
        return "vllm's"
