"""The CPU recovered-token sampling keeps vLLM's distribution.

Where a draft token is rejected, vLLM samples the replacement from the
residual distribution: ``p`` without the draft token when the draft has no
probabilities (n-gram, retrieval), ``max(p - q, 0)`` normalised when it has
them. The plugin's CPU stand-in draws its noise more cheaply and only for
requests with drafts; these tests compare its samples with those residuals
computed here from ``p`` and ``q`` (chi-square), and show that the same test
rejects a wrong noise.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch
from scipy.stats import chisquare

from tests.helpers.cpu_kernels import cpu_kernels

P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q = torch.tensor([0.50, 0.10, 0.25, 0.05, 0.05, 0.05])
DRAFT = 0
P_WITHOUT_DRAFT = P.clone()
P_WITHOUT_DRAFT[DRAFT] = 0
"""The residual of a draft without probabilities: ``p`` without the draft token."""
N = 6000


class _Meta:
    def __init__(self, generators=None):
        self.generators = generators or {}


def _recovered(num_draft_tokens, probs, draft_probs=None, generators=None, fn=None):
    from vllm.v1.sample import rejection_sampler

    cpu_kernels()
    fn = fn or rejection_sampler.sample_recovered_tokens
    n_tokens = sum(num_draft_tokens)
    cu = torch.tensor(num_draft_tokens).cumsum(0).to(torch.int32)
    draft_ids = torch.full((n_tokens,), DRAFT, dtype=torch.int32)
    target = probs.repeat(n_tokens, 1).contiguous()
    dp = None if draft_probs is None else draft_probs.repeat(n_tokens, 1).contiguous()
    return fn(max(num_draft_tokens), num_draft_tokens, cu, draft_ids, dp, target,
              _Meta(generators), "cpu")


def _p_value(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=len(expected_probs)).double()
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a token the residual gives no mass was drawn"
    observed = counts[keep].numpy()
    expected = expected_probs[keep].double().numpy()
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


def test_the_cpu_stand_in_is_installed():
    from vllm.v1.sample import rejection_sampler

    from vllm_specplug.runner.cpu_fixes import _sample_recovered_tokens_cpu

    cpu_kernels()
    assert rejection_sampler.sample_recovered_tokens is _sample_recovered_tokens_cpu


def test_without_draft_probs_the_draft_token_is_taken_out_of_p():
    torch.manual_seed(0)
    assert _p_value(_recovered([1] * N, P), P_WITHOUT_DRAFT) > 1e-3


def test_with_draft_probs_the_residual_is_p_minus_q():
    torch.manual_seed(1)
    tokens = _recovered([2] * (N // 2), P, draft_probs=Q)
    assert _p_value(tokens, (P - Q).clamp(min=0)) > 1e-3


def test_the_same_test_rejects_uniform_noise():
    """Power: argmax(residual / U) with U uniform is not the residual
    distribution, and the test above says so."""
    from vllm.v1.sample.rejection_sampler import _sample_recovered_tokens

    def wrong(max_spec_len, num_draft_tokens, cu, draft_ids, dp, target, meta, device):
        inv_q = torch.rand((len(num_draft_tokens), target.shape[-1])).reciprocal()
        out = torch.empty_like(draft_ids)
        _sample_recovered_tokens(out, cu, draft_ids, dp, target, inv_q,
                                 max_spec_len=max_spec_len)
        return out

    torch.manual_seed(2)
    assert _p_value(_recovered([1] * N, P, fn=wrong), P_WITHOUT_DRAFT) < 1e-6


@pytest.mark.parametrize("drafts", [[0, 2, 0, 1], [3, 0]])
def test_only_requests_with_drafts_draw_and_seeds_repeat(drafts):
    """A request without drafts leaves its generator untouched (as in
    vLLM); a seeded request with drafts gets the same tokens again from the
    same seed."""

    def gens():
        return {i: torch.Generator().manual_seed(100 + i) for i in range(len(drafts))}

    first, second = gens(), gens()
    a = _recovered(drafts, P, generators=first)
    b = _recovered(drafts, P, generators=second)
    assert torch.equal(a, b)
    untouched = gens()
    for i, n in enumerate(drafts):
        same = torch.equal(first[i].get_state(), untouched[i].get_state())
        assert same == (n == 0), i
