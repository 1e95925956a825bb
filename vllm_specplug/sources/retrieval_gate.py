"""When to retrieve from the context, and which earlier occurrence to copy.

ReSpec's two decisions (section 3.2-3.3), as pieces any method can use:

* ``choose_key``: the entropy-guided trigger. For each key length
  ``k = 1..l``, ``H_k`` is the mean entropy of the target's distributions
  over the key's positions (Eq. 1), ``C_k = H_k + lambda_e / k`` (Eq. 2),
  ``k* = argmin C_k`` (Eq. 3); retrieval fires when ``H_{k*} <= theta``.
  Which distributions: the paper's ``P_{t-k+i}`` for ``i = 1..k``. At
  drafting time the distribution after the newest token is not computed
  yet (the target reads that token in the next step), so here the key's
  ``k`` entropies are those of the distributions that produced the key's
  last ``k`` tokens: the entropy recorded at positions ``t-k .. t-1``. That
  is the same window shifted by one; it measures how predictable the text
  that the key is made of was.
* ``PositionScores``: feedback-driven selection. Every earlier occurrence
  (end position) of the key is a candidate with an EMA score (new ones start
  at ``init``); those below ``theta_score`` are dropped, the best ``top``
  kept. After verification the winner gets ``R = L_acc / L_draft`` (Eq. 5),
  the other selected candidates ``R = 0``, and ``S <- (1-alpha) S + alpha R``
  (Eq. 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KeyChoice:
    length: int
    """``k*``; 0 when there is not a single entropy to judge by."""
    entropy: float
    """``H_{k*}``, the mean entropy over the key (nats)."""
    fire: bool
    """``H_{k*} <= theta``."""


def choose_key(entropies: Sequence[float], max_len: int, lambda_e: float,
               theta: float) -> KeyChoice:
    """``entropies``: the request's recorded entropies, oldest first, whose
    last element belongs to the distribution that produced the newest token.
    Keys longer than the entropies known are not considered."""
    ent = np.asarray(entropies, dtype=np.float64)
    best = None
    for k in range(1, min(max_len, ent.shape[0]) + 1):
        h = float(ent[ent.shape[0] - k :].mean())
        c = h + lambda_e / k
        if best is None or c < best[0]:
            best = (c, k, h)
    if best is None:
        return KeyChoice(0, float("inf"), False)
    _, k, h = best
    return KeyChoice(k, h, h <= theta)


class PositionScores:
    """EMA quality scores of one request's match positions."""

    def __init__(self, alpha: float = 0.3, init: float = 0.5) -> None:
        self.alpha, self.init = alpha, init
        self.scores: dict[int, float] = {}

    def select(self, ends: Sequence[int], theta: float, top: int) -> list[int]:
        """The best ``top`` of ``ends`` scoring at least ``theta`` (ties: the
        most recent occurrence first: it is the likeliest to be continued)."""
        scored = [(self.scores.get(int(p), self.init), int(p)) for p in ends]
        keep = [(s, p) for s, p in scored if s >= theta]
        keep.sort(key=lambda sp: (-sp[0], -sp[1]))
        return [p for _, p in keep[:top]]

    def feedback(self, selected: Sequence[int], winner: int | None, accepted: int,
                 drafted: int) -> None:
        """Eq. 4-5 for every selected position (``winner``: the one whose
        continuation the target followed furthest, None if none)."""
        for p in selected:
            r = accepted / drafted if p == winner and drafted > 0 else 0.0
            s = self.scores.get(int(p), self.init)
            self.scores[int(p)] = (1 - self.alpha) * s + self.alpha * r
