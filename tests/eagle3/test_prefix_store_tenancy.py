"""The head's prefix store by tenant (``eagle3/runtime.py``, fed by
``eagle3_tree`` and the methods built on it): a request whose first blocks
vLLM served from its prefix cache gets their head K/V from the store only
if a request of its own tenant stored them; a request without a tenant
neither stores nor fills."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.methods.budget import propose
from tests.helpers.contexts import ref_model_ctx

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.methods.eagle3_tree import Eagle3TreeConfig, Eagle3TreeProposer

A, B = "t:aaaa", "t:bbbb"
N = 40  # prompt rows: blocks 0 and 1 (positions 0..31) finish, 32..39 do not


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 3 * 576, generator=g)


@pytest.fixture
def prop(ref_model):
    return Eagle3TreeProposer(Eagle3TreeConfig(depth=2, topk=2), ref_model_ctx(ref_model))


def _step(prop, rid, tenant, tokens, aux, start=0):
    """A prompt step of rows ``start..N-1`` (rows before ``start`` came
    from vLLM's prefix cache); returns its tree."""
    prop.add_request(rid)
    req = StepRequest(req_id=rid, token_ids=tokens, num_prompt_tokens=N, sampled=True,
                      verified_pos=start, aux_hidden=aux[start:], tenant=tenant)
    return propose(prop, [req])[0]


def test_a_stored_prefix_serves_its_own_tenant_only(prop, rows):
    tokens = np.arange(100, 100 + N + 1, dtype=np.int64)
    assert _step(prop, "a1", A, tokens, rows) is not None
    kv_a1 = prop.runtime.states["a1"].k[:32].clone()
    prop.remove_request("a1")
    assert len(prop.runtime.store) == 2
    s = prop.runtime.stats

    # A again, its first 32 positions from vLLM's prefix cache: filled
    assert _step(prop, "a2", A, tokens, rows, start=32) is not None
    assert s.store_hits == 1 and s.store_misses == 0
    assert torch.equal(prop.runtime.states["a2"].k[:32], kv_a1)

    # the same tokens under another tenant, the public pool, or no tenant: refused
    for rid, tenant in (("b1", B), ("p1", "public"), ("n1", None)):
        assert _step(prop, rid, tenant, tokens, rows, start=32) is None
        assert not prop.runtime.ready(rid, len(tokens))
    assert s.store_hits == 1 and s.store_misses == 3


def test_a_request_without_tenant_stores_nothing(prop, rows):
    tokens = np.arange(300, 300 + N + 1, dtype=np.int64)
    assert _step(prop, "n1", None, tokens, rows) is not None  # it drafts from its own rows
    assert len(prop.runtime.store) == 0
    prop.remove_request("n1")
    assert _step(prop, "n2", None, tokens, rows, start=32) is None
    assert prop.runtime.stats.store_misses == 1
