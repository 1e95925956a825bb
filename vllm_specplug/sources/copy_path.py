"""How much a copied continuation is worth, learned while serving.

A copy path (prompt lookup: the tokens after an earlier occurrence of the
context's suffix, ``sources/ngram.py``) is the strongest draft when the
context repeats, and a poor one after a one-token match. Methods that mix a
copy path with other candidates (``adapld``'s branches, ``recycle``'s
template) need per-node scores on one scale -- the chance the node is
accepted -- so ``normalize_tree`` can cut the merged tree best-first and a
long, confident copy keeps the budget while a short, uncertain one leaves it
to the alternatives.

``Rate`` is a success ratio with a prior; ``CopyConfidence`` keeps two per
match length (capped at ``max_n``): the chance the copy's first token is
accepted, and the chance each further one is, given its parent was. Node
``d`` of a copy scores ``first * next ** (d - 1)``. The methods feed back
what the target verified (``record``), so the estimates follow the workload.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rate:
    """``(successes + prior * weight) / (trials + weight)``."""

    prior: float
    weight: float = 8.0
    successes: float = 0.0
    trials: float = 0.0

    @property
    def value(self) -> float:
        return (self.successes + self.prior * self.weight) / (self.trials + self.weight)

    def add(self, successes: float, trials: float) -> None:
        self.successes += successes
        self.trials += trials


# Priors before any feedback (per match length 1, 2, 3, 4+), roughly the
# acceptance of pld's chains on the reference model over Spec-Bench; the
# feedback takes over after a few dozen drafts.
FIRST_PRIOR = (0.35, 0.5, 0.6, 0.7)
NEXT_PRIOR = (0.6, 0.7, 0.75, 0.8)


class CopyConfidence:
    """Per-node acceptance estimates of copy paths, by match length."""

    def __init__(self, max_n: int = 4) -> None:
        self.max_n = max(1, max_n)
        self.first = [Rate(FIRST_PRIOR[min(i, 3)]) for i in range(self.max_n)]
        self.next = [Rate(NEXT_PRIOR[min(i, 3)]) for i in range(self.max_n)]

    def _b(self, n: int) -> int:
        return min(max(n, 1), self.max_n) - 1

    def scores(self, n: int, length: int, scale: float = 1.0) -> list[float]:
        """Acceptance estimate of each of ``length`` copied nodes after a
        match of ``n`` tokens (times ``scale``, e.g. a parent's score)."""
        b = self._b(n)
        s, q = scale * self.first[b].value, self.next[b].value
        out = []
        for _ in range(length):
            out.append(s)
            s *= q
        return out

    def record(self, n: int, verified: int, accepted: int) -> None:
        """A copy of ``verified`` nodes (those the target saw) after an
        ``n``-token match had its first ``accepted`` tokens accepted."""
        if verified <= 0:
            return
        b = self._b(n)
        accepted = min(accepted, verified)
        self.first[b].add(1.0 if accepted else 0.0, 1.0)
        if accepted:
            # tokens 2.. were tried while their parent was accepted
            self.next[b].add(accepted - 1, min(accepted, verified - 1))

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for ``stats()``."""
        out = {}
        for b in range(self.max_n):
            out[f"copy_first_n{b + 1}"] = round(self.first[b].value, 4)
            out[f"copy_next_n{b + 1}"] = round(self.next[b].value, 4)
        return out


def accepted_prefix(path, verified_tokens) -> int:
    """How many leading tokens of ``path`` the verified tokens repeat."""
    m = 0
    for a, b in zip(path, verified_tokens):
        if int(a) != int(b):
            break
        m += 1
    return m
