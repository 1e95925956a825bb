"""Cost-aware draft budget: how much of each proposed tree is worth verifying.

One package, one concern per module:

- ``cost``: step time as a function of the rows verified, learned online;
- ``acceptance``: P(node accepted) by depth, sibling rank and source;
- ``shadow``: the outcome every proposed node would have had, from the
  tokens the target produced (feeds ``acceptance`` at no verification cost);
- ``gate``: whether a step drafts at all (drafting must pay for itself);
- ``controller``: the cut of each step's trees that maximises expected
  tokens per second, from the three above;
- ``fixed``: the pinned size of a method with ``cost_aware: false``.

The runner talks to one budget object per engine (``make_budget``), either
kind, through the same methods.
"""

from __future__ import annotations

from vllm_specplug.engine.budget.acceptance import AcceptanceModel, sibling_ranks
from vllm_specplug.engine.budget.controller import (
    BudgetController,
    BudgetStats,
    Choice,
    subtree,
)
from vllm_specplug.engine.budget.cost import StepCost
from vllm_specplug.engine.budget.fixed import FixedBudget
from vllm_specplug.engine.budget.gate import CHEAP_CATCH_UP, DraftGate, pick_explorer
from vllm_specplug.engine.budget.shadow import shadow_outcomes


def make_budget(cost_aware: bool) -> BudgetController | FixedBudget:
    """The budget a method's ``cost_aware`` option asks for."""
    return BudgetController() if cost_aware else FixedBudget()


__all__ = [
    "CHEAP_CATCH_UP",
    "AcceptanceModel",
    "BudgetController",
    "BudgetStats",
    "Choice",
    "DraftGate",
    "FixedBudget",
    "StepCost",
    "make_budget",
    "pick_explorer",
    "shadow_outcomes",
    "sibling_ranks",
    "subtree",
]
