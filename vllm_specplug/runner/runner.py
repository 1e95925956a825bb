"""The one place that touches vLLM's model-runner internals (vLLM 0.32.0).

``SpecplugRunnerMixin`` sits in front of vLLM's V1 ``GPUModelRunner`` (and
its CPU subclass) and composes one part per module (docs/design.md draws a
step's data flow through them):

- ``setup.py``: the method, its budget, hidden-state capture and the tree
  attention wrapper, at start-up;
- ``request_tracking.py``: vLLM's request updates mirrored to the method;
- ``verify_step.py``: ``_prepare_inputs`` (tree positions and masks) and
  ``_sample`` (tree verification, then the accepted path's KV move);
- ``capture.py``: top-k, entropies and hidden-state rows methods read;
- ``draft.py``: ``propose_draft_token_ids`` (one ``StepRequest`` per
  request, the method's trees through its guard);
- ``budget_glue.py``: what the cost-aware budget learns and its cut.

Upgrading vLLM means re-reading the methods overridden there.
"""

from __future__ import annotations

from typing import Any

from vllm_specplug.runner.budget_glue import BudgetMixin
from vllm_specplug.runner.capture import CaptureMixin
from vllm_specplug.runner.cpu_fixes import apply_vllm_cpu_fixes
from vllm_specplug.runner.draft import DraftMixin
from vllm_specplug.runner.guard import guard_for
from vllm_specplug.runner.logit_rows import entropy as _entropy
from vllm_specplug.runner.request_tracking import RequestTrackingMixin
from vllm_specplug.runner.setup import SetupMixin, SpecplugDrafter
from vllm_specplug.runner.step_state import StepState, root_rows
from vllm_specplug.runner.verify_step import VerifyMixin, _chain_only, path_chain_metadata

__all__ = [
    "SpecplugDrafter",
    "SpecplugRunnerMixin",
    "StepState",
    "_chain_only",
    "_entropy",
    "apply_vllm_cpu_fixes",
    "path_chain_metadata",
    "root_rows",
]


class SpecplugRunnerMixin(SetupMixin, RequestTrackingMixin, VerifyMixin, CaptureMixin,
                          DraftMixin, BudgetMixin):
    """Mixed in before ``GPUModelRunner``/``CPUModelRunner`` (see module doc).
    The parts override disjoint vLLM methods, so each ``super()`` call
    reaches vLLM's own."""

    # --------------------------------------------------------------- stats
    def _sp_tree_attention_path(self) -> str:
        """Which code attends the tree rows: ``gpu`` (Triton kernel),
        ``native`` (the CPU kernel) or ``aten`` (the CPU fallback)."""
        if self.device.type != "cpu":
            return "gpu"
        from vllm_specplug.kernels import cpu_tree_attention

        return "native" if cpu_tree_attention.loaded() else "aten"

    def specplug_stats(self) -> dict[str, Any]:
        stats = self._sp_stats.as_dict()
        stats["live_trees"] = len(self._sp_requests.trees)  # 0 once every request is gone
        stats["tree_attention"] = self._sp_tree_attention_path()
        # the target's linear layers on the small-row CPU kernel (0: oneDNN only)
        target = getattr(self, "_sp_target", None)
        routed = target.linear_routed if target is not None else []
        stats["cpu_linear_layers"] = len(routed)
        # which layers: routed layers per weight shape "KxN" (benchmarks record it)
        stats["cpu_linear_shapes"] = {s: routed.count(s) for s in sorted(set(routed))}
        budget = self._sp_budget.as_dict()
        if budget is not None:
            stats["budget"] = budget
        if self._sp_proposer is not None:
            prop = self._sp_proposer
            own = guard_for(self).call("stats", prop.stats)
            report = None if own is None else guard_for(self).call(
                "stats", lambda: prop.report(own))
            if report is None:  # the method's own counters failed (counted, logged)
                stats["method"] = {"error": "the method's stats() raised; see the log"}
                stats["method_counters"] = []
            else:
                stats["method"] = report
                # Which of those are running totals (the rest are levels/rates).
                stats["method_counters"] = sorted(own.counters)
        return stats
