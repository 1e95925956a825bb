"""The runner's side of the cost-aware budget (``engine/budget/``): what
each step teaches it, and the cut of the step's trees to what pays."""

from __future__ import annotations

from vllm_specplug.runner.step_state import tp_rank0_float


class BudgetMixin:
    """Feeds the budget and applies its cut (see module doc)."""

    def _sp_apply_budget(self, batch, trees, scheduler_output, step_seconds):
        """Cut the step's trees to what pays (``engine/budget/``).

        ``step_seconds``: this step's forward + verification time, 0 unless
        every request decoded (prefill chunks do not belong on the curve).
        Every tensor-parallel rank must cut alike, so the time is rank 0's.
        """
        ctl = self._sp_budget
        step_seconds = tp_rank0_float(step_seconds)
        if step_seconds > 0:
            ctl.observe_step(scheduler_output.total_num_scheduled_tokens, step_seconds)
        state = self._sp_state
        for i, sreq in enumerate(batch):
            rows = state.accepted_rows.get(i) if state is not None else None
            accepted = len(rows) - 1 if rows is not None and sreq.draft_kept else None
            ctl.learn(sreq.req_id, sreq.token_ids, accepted)
        cut, _ = ctl.choose([s.req_id for s in batch], trees,
                            [len(s.token_ids) for s in batch],
                            rows=sum(1 for s in batch if s.sampled))
        return cut

    def specplug_reset_budget(self) -> bool:
        """Forget what the budget learned (engine/budget.BudgetController.
        reset_learning): it starts cold, as at start-up. For a
        warm-up that must not teach: ``llm.collective_rpc(
        "specplug_reset_budget")``. False with a pinned budget (nothing
        learned)."""
        return self._sp_budget.reset_learning()
