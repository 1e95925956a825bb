"""`specplug selftest`: its statistics against scipy, and (slow) a full run
on the tiny model."""

from __future__ import annotations

import random

import pytest
from scipy.stats import chi2_contingency

from vllm_specplug.selftest import homogeneity_pvalue


@pytest.mark.parametrize("shift", [0.0, 0.15])
def test_homogeneity_pvalue_matches_scipy(shift):
    rng = random.Random(0)
    a = [min(int(rng.expovariate(0.3)), 20) for _ in range(2000)]
    b = [min(int(rng.expovariate(0.3 + shift)), 20) for _ in range(1500)]
    keys = sorted(k for k in set(a) | set(b) if a.count(k) + b.count(k) >= 10)
    rest = [sum(1 for x in s if x not in keys) for s in (a, b)]
    table = [[a.count(k) for k in keys] + [rest[0]], [b.count(k) for k in keys] + [rest[1]]]
    table = [[r[j] for j in range(len(r)) if table[0][j] + table[1][j]] for r in table]
    want = chi2_contingency(table, correction=False).pvalue
    assert homogeneity_pvalue(a, b) == pytest.approx(want, rel=1e-6, abs=1e-12)


@pytest.mark.slow
@pytest.mark.engine
def test_selftest_passes_on_tiny_model(tiny_model, capsys):
    from vllm_specplug.cli import main

    rc = main(["selftest", "--model", tiny_model, "--methods", "pld", "oracle",
               "--samples", "300", "--max-tokens", "24"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all checks passed" in out and "PASS" in out
