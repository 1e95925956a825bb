"""The sampling check's statistic (tests/helpers/sampling_stats.py) at the
size the engine tests use (tests/methods/sampling.py: ``SAMPLES`` samples
of three tokens, the last two tested, alpha ``ALPHA``), on simulated target
laws: a correct sampler passes, and tree rules that skew the law are
caught."""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import pytest

from tests.helpers.sampling_stats import Fit, homogeneity_pvalue, rank_fit
from tests.methods.sampling import ALPHA, SAMPLES, TOP_LOGPROBS

VOCAB = 64
N = SAMPLES
POSITIONS = (1, 2)  # max_tokens=3: the tokens tree verification produced


@lru_cache(maxsize=None)
def _law(prefix: tuple, peak: float = 2.5) -> np.ndarray:
    """The simulated target's next-token law after ``prefix`` (fixed per
    prefix; at ``peak`` 2.5 the likeliest token has about half the mass, as
    a small chat model's next token often does)."""
    rng = np.random.default_rng(zlib.crc32(repr(prefix).encode()))
    z = rng.standard_normal(VOCAB) * peak
    p = np.exp(z - z.max())
    return p / p.sum()


def _exact(p, rng) -> int:
    return int(rng.choice(VOCAB, p=p))


def _naive_tree_rule(p, rng, siblings: int = 4) -> int:
    """A broken multi-draft rule: each sibling (the law's top tokens, a
    perfect drafter) accepted with its probability, without the residual
    update, else a fresh sample: the top siblings come out too often."""
    for d in np.argsort(-p)[:siblings]:
        if rng.random() < p[d]:
            return int(d)
    return _exact(p, rng)


def _top_boost(p, rng, shift: float = 0.2) -> int:
    """A slightly skewed law: ``shift`` of the mass moved to the top token."""
    q = p * (1 - shift)
    q[np.argmax(p)] += shift
    return _exact(q, rng)


def _samples(rule, seed: int, n: int = N) -> list[list[int]]:
    """Three tokens per sample: the first always exact (it comes from the
    prefill), the next ones by ``rule`` (tree verification's)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s: list[int] = []
        for pos in range(3):
            p = _law(tuple(s))
            s.append(_exact(p, rng) if pos == 0 else rule(p, rng))
        out.append(s)
    return out


def _fit(samples) -> Fit:
    """The engine check's fit: each tested token against its own law's
    ``TOP_LOGPROBS`` likeliest tokens and itself."""
    tokens, laws = [], []
    for s in samples:
        for pos in POSITIONS:
            p = _law(tuple(s[:pos]))
            known = set(np.argsort(-p)[:TOP_LOGPROBS].tolist()) | {s[pos]}
            tokens.append(s[pos])
            laws.append({int(t): float(p[t]) for t in known})
    return rank_fit(tokens, laws)


def test_exact_sampling_passes():
    fits = [_fit(_samples(_exact, seed)) for seed in range(10)]
    assert all(f.pvalue > ALPHA for f in fits), [f.pvalue for f in fits]
    assert all(f.tested == N * len(POSITIONS) for f in fits)


@pytest.mark.parametrize("rule", [_naive_tree_rule, _top_boost])
def test_a_skewed_tree_rule_is_caught(rule):
    caught = sum(_fit(_samples(rule, seed)).pvalue < ALPHA for seed in range(10))
    assert caught >= 9, caught


def test_rank_fit_by_hand():
    # one law (0.5, 0.3, 0.2), two cells (rank 0, the rest): 60 of 100
    # tokens at rank 0 against 50 expected, variance 100 * 0.5 * 0.5
    law = {7: 0.5, 8: 0.3, 9: 0.2}
    fit = rank_fit([7] * 60 + [8] * 25 + [9] * 15, [law] * 100, cells=2)
    assert fit.dof == 1 and fit.tested == 100
    assert fit.statistic == pytest.approx(10 ** 2 / 25)
    # ranks follow each token's own law: token 8 is rank 0 where it is likeliest
    flipped = {7: 0.3, 8: 0.5, 9: 0.2}
    # (half of each group at its rank 0: 25 of 50, as expected)
    tokens = [7] * 15 + [8] * 15 + [8] * 10 + [7] * 10
    fit = rank_fit(tokens, [law] * 30 + [flipped] * 20, cells=2)
    assert fit.statistic == pytest.approx(0.0)
    # all 50 at rank 0: 25 over, variance 30 * 0.25 + 20 * 0.25
    fit = rank_fit([7] * 30 + [8] * 20, [law] * 30 + [flipped] * 20, cells=2)
    assert fit.statistic == pytest.approx(25 ** 2 / 12.5)
    assert rank_fit([], []).pvalue == 1.0


def test_homogeneity_tells_two_laws_apart():
    rng = np.random.default_rng(0)
    a = list(rng.choice(4, 600, p=[0.4, 0.3, 0.2, 0.1]))
    b = list(rng.choice(4, 600, p=[0.4, 0.3, 0.2, 0.1]))
    c = list(rng.choice(4, 600, p=[0.1, 0.2, 0.3, 0.4]))
    assert homogeneity_pvalue(a, b) > ALPHA > homogeneity_pvalue(a, c)
