"""`suffix_tree` keeps earlier responses per tenant: a tenant drafts from its
own earlier requests, never from another tenant's; requests without a tenant
(isolation ``strict``, or untagged) draft from their own tokens only; the
tenants kept and the responses kept are bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.sources import suffix_cache

pytestmark = pytest.mark.skipif(not suffix_cache.available(),
                                reason="arctic-inference is not installed")

# A's answer continues "40 41" with "42 .. 49"; B's prompt continues it once
# with "50 51 52" and ends with it. Arctic drafts from the request's own
# trees or from the global one, whichever draft scores more: after A, a
# request of A's tenant ending in "40 41" drafts A's answer (eight nodes
# seen once each, probability 1), one of any other tenant its own prompt.
PROMPT_A = [10, 11, 12]
ANSWER_A = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
PROMPT_B = [20, 40, 41, 50, 51, 52, 21, 40, 41]


def _proposer(**options):
    from vllm_specplug.methods.suffix_tree import SuffixTreeConfig, SuffixTreeProposer

    ctx = ProposerContext(vocab_size=100, hidden_size=8, num_speculative_tokens=8,
                          max_model_len=256, device=torch.device("cpu"),
                          dtype=torch.float32, model_path="/m", tokenizer_path="/m")
    config = SuffixTreeConfig(cost_aware=False, max_spec_factor=4.0, min_token_prob=0.01,
                              **options)
    return SuffixTreeProposer(config, ctx)


def _draft(prop, rid: str, tenant: str | None, tokens: list[int], num_prompt: int):
    req = StepRequest(req_id=rid, token_ids=np.asarray(tokens, dtype=np.int64),
                      num_prompt_tokens=num_prompt, sampled=True,
                      verified_pos=len(tokens) - 1, budget=8, tenant=tenant)
    return prop.propose([req])[0]


def _answer(prop, rid: str, tenant: str | None, prompt=PROMPT_A, answer=ANSWER_A):
    """``rid`` reads ``prompt`` and generates ``answer`` a token a step, then leaves."""
    prop.add_request(rid)
    for n in range(1, len(answer) + 1):
        _draft(prop, rid, tenant, prompt + answer[:n], len(prompt))
    prop.remove_request(rid)


def _ask_b(prop, rid: str, tenant: str | None):
    prop.add_request(rid)
    return _draft(prop, rid, tenant, PROMPT_B, len(PROMPT_B))


def _shape(tree):
    return None if tree is None else (tree.tokens, tree.parents, tree.scores)


def _fresh(tenant: str | None = "t:any", **options):
    return _shape(_ask_b(_proposer(**options), "fresh", tenant))


def test_fresh_draft_is_the_requests_own_continuation():
    # the expectation every other test compares with: only "50 51 52 21";
    # "40 41" occurs twice, once followed by 50 and once at the very end
    tree = _ask_b(_proposer(), "b", "t:b")
    assert tree.tokens[:3] == [50, 51, 52] and 42 not in tree.tokens
    assert tree.scores[0] == pytest.approx(1 / 2)


def test_other_tenant_drafts_as_a_fresh_proposer_and_own_tenant_sees_its_answer():
    prop = _proposer()
    _answer(prop, "a1", "t:a")
    assert _shape(_ask_b(prop, "b1", "t:b")) == _fresh()
    assert _shape(_ask_b(prop, "p1", "public")) == _fresh()
    assert _ask_b(prop, "a2", "t:a").tokens == [42, 43, 44, 45, 46, 47, 48, 49]
    assert prop.stats().gauges["tenants"] == 3


def test_requests_without_a_salt_share_the_public_pool():
    prop = _proposer()
    _answer(prop, "p1", "public")
    assert 42 in _ask_b(prop, "p2", "public").tokens
    assert _shape(_ask_b(prop, "a1", "t:a")) == _fresh()


def test_tenant_none_keeps_nothing_across_requests():
    prop = _proposer()
    _answer(prop, "n1", None)
    assert _shape(_ask_b(prop, "n2", None)) == _fresh(None)
    assert prop.stats().gauges["cached_responses"] == 0
    assert _shape(_ask_b(prop, "p1", "public")) == _fresh()
    # its own tokens still draft
    own = _draft(prop, "n3", None, PROMPT_A + ANSWER_A + [9, 40, 41], len(PROMPT_A))
    assert own.tokens[:3] == [42, 43, 44]


def test_least_recent_idle_tenant_loses_its_answers_past_max_tenants():
    prop = _proposer(max_tenants=2)
    _answer(prop, "a1", "t:a")
    _answer(prop, "b1", "t:b")
    _answer(prop, "c1", "t:c")  # a third tenant: A, the least recent, goes
    assert prop.stats().gauges["tenants"] == 2
    assert _shape(_ask_b(prop, "a2", "t:a")) == _fresh(max_tenants=2)
    assert 42 in _ask_b(prop, "c2", "t:c").tokens


def test_a_tenant_with_a_running_request_keeps_its_answers():
    prop = _proposer(max_tenants=2)
    _answer(prop, "a1", "t:a")
    _ask_b(prop, "a2", "t:a")  # still running
    _answer(prop, "b1", "t:b")
    _answer(prop, "c1", "t:c")  # B goes: A is older but has a request running
    assert 42 in _draft(prop, "a2", "t:a", PROMPT_B, len(PROMPT_B)).tokens
    prop.remove_request("a2")
    assert _shape(_ask_b(prop, "b2", "t:b")) == _fresh(max_tenants=2)


def test_max_cached_requests_counts_all_tenants_oldest_first():
    # a running request's response is cached too, from its start
    prop = _proposer(max_cached_requests=3)
    _answer(prop, "a1", "t:a")
    _answer(prop, "b1", "t:b")
    _answer(prop, "c1", "t:c")
    assert prop.stats().gauges["cached_responses"] == 3
    # the fourth response: A's, the oldest, goes; B's is still there
    assert 42 in _ask_b(prop, "b2", "t:b").tokens
    assert prop.stats().gauges["cached_responses"] == 3
    # the fifth: B's first goes, A's was gone already
    assert _shape(_ask_b(prop, "a2", "t:a")) == _fresh(max_cached_requests=3)
    assert prop.stats().gauges["cached_responses"] == 3


def test_a_request_is_stopped_in_its_own_tenants_cache():
    prop = _proposer()
    _answer(prop, "a1", "t:a")
    gauges = prop.stats().gauges
    assert gauges["live_requests"] == 0 and gauges["cached_responses"] == 1
    # preempted and back: fed again in the same cache, its answer not doubled
    _answer(prop, "a1", "t:a")
    assert prop.stats().gauges["cached_responses"] == 1
