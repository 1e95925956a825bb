"""The pinned budget: every tree the method drafts is verified whole.

What a method with ``cost_aware: false`` gets. It answers the runner the way
``controller.BudgetController`` does, with nothing learned: the gate is
always open, no step explores, drafting-only side work always runs, and
``choose`` keeps every tree as drafted (the method already sized it to at
most ``num_speculative_tokens`` nodes).
"""

from __future__ import annotations

from vllm_specplug.engine.budget.controller import Choice
from vllm_specplug.engine.tree import DraftTree


class FixedBudget:
    """The size the method drafted, pinned (see the module docstring)."""

    will_draft = True
    exploring = False
    side_work = True

    def draft_now(self) -> bool:
        return True

    def token_seconds(self, rows: int) -> float:
        """Nothing measured: an accepted token's worth is unknown (0)."""
        return 0.0

    def learn(self, req_id: str, token_ids, accepted: int | None = None) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass

    def observe_step(self, rows: int, seconds: float) -> None:
        pass

    def observe_side(self, seconds: float) -> None:
        pass

    def observe_propose(self, seconds: float, drafted: bool, requests: int = 1) -> None:
        pass

    def choose(self, req_ids: list[str], trees: list[DraftTree | None],
               token_lens: list[int], rows: int) -> tuple[list[DraftTree | None], Choice]:
        """Every tree as drafted (an empty tree counts as no draft)."""
        out = [t if t is not None and len(t) else None for t in trees]
        sizes = [len(t) if t is not None else 0 for t in out]
        return out, Choice(sizes, [0.0] * len(out), 0.0, 0.0)

    def reset_learning(self) -> bool:
        """Nothing learned, nothing to forget: False."""
        return False

    def as_dict(self) -> dict | None:
        """No budget statistics (the size is pinned): None."""
        return None
