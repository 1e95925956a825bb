"""Statistics of the sampling-distribution checks.

``homogeneity_pvalue``: two samples, one law? (chi-square homogeneity).

``rank_fit``: do sampled tokens follow *known* laws, one law per token?
Each token's rank in its own law (likeliest first; ranks past
``cells - 2`` pooled) is one categorical draw with that law's rank
probabilities; the rank counts' deviation from their expectation, weighed
by its covariance (a sum of independent, differently distributed one-hot
vectors), is chi-square with ``cells - 1`` degrees of freedom. A rule that
favours likely tokens (drafts are likely tokens) shows in the low ranks.
No grouping by prefix: every token counts, however spread the prefixes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2, chi2_contingency


def homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square p-value that a and b come from one distribution (tokens
    seen under 10 times in both pooled)."""
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rest = [sum(c[k] for k in c if k not in keys) for c in (ca, cb)]
    table = np.array([[ca[k] for k in keys] + [rest[0]], [cb[k] for k in keys] + [rest[1]]])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table).pvalue


@dataclass
class Fit:
    """A goodness-of-fit test's outcome."""

    statistic: float
    dof: int
    """Degrees of freedom: 0 means nothing was tested."""
    tested: int
    """Sampled tokens that entered the statistic."""

    @property
    def pvalue(self) -> float:
        return float(chi2.sf(self.statistic, self.dof)) if self.dof > 0 else 1.0


def rank_fit(tokens: list[int], laws: list[dict[int, float]], cells: int = 6) -> Fit:
    """Fit of ``tokens[i]`` to ``laws[i]`` (``{token: p}``, as many tokens as
    known, at least ``cells - 1``) by rank (see the module docstring)."""
    k = cells - 1
    observed = np.zeros(cells)
    expected = np.zeros(cells)
    cov = np.zeros((k, k))
    for tok, law in zip(tokens, laws):
        ranked = sorted(law, key=lambda t: (-law[t], t))[:k]
        p = np.array([law[t] for t in ranked] + [0.0] * (k - len(ranked)))
        p = np.append(p, max(0.0, 1.0 - p.sum()))
        rank = ranked.index(tok) if tok in ranked else k
        observed[rank] += 1
        expected += p
        cov += np.diag(p[:k]) - np.outer(p[:k], p[:k])
    d = (observed - expected)[:k]
    stat = float(d @ np.linalg.pinv(cov) @ d) if len(tokens) else 0.0
    return Fit(stat, k if len(tokens) else 0, len(tokens))
