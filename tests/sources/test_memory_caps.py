"""Memory caps of the model-free cross-request structures: adjacency tables
held per request (``max_request_tables``) and the response tokens of the
global suffix trees (``max_cached_tokens``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.sources import suffix_cache
from vllm_specplug.sources.adjacency import UNTOUCHED, AdjacencyTable
from vllm_specplug.sources.adjacency_drafter import AdjacencyDrafter
from vllm_specplug.sources.template import TreeTemplate

VOCAB, K = 100, 4
TABLE_BYTES = VOCAB * K * 4  # int32


def _teach(req_id: str, seq: list[int], tenant: str | None = None) -> StepRequest:
    """A prompt step whose top-k says each token is followed by the next."""
    topk = torch.tensor([[seq[i + 1], 70, 71, 72] for i in range(len(seq) - 1)])
    return StepRequest(req_id, np.array(seq), len(seq) - 1, False, 0, topk_ids=topk,
                       tenant=tenant)


def _ask(req_id: str, last: int, tenant: str | None = None) -> StepRequest:
    return StepRequest(req_id, np.array([1, last]), 1, True, 1, tenant=tenant)


def _drafter(**kw) -> AdjacencyDrafter:
    return AdjacencyDrafter(AdjacencyTable(VOCAB, K), TreeTemplate.from_spec("4,2,1", K),
                            **kw)


def test_requests_past_max_request_tables_get_no_table_until_one_is_freed():
    d = _drafter(max_request_tables=2)
    d.learn([_teach("a", [5, 6]), _teach("b", [5, 7]), _teach("c", [5, 8])])
    assert len(d.tables) == 3  # the start-up table and two requests' own
    assert sum(t.nbytes for t in d.tables) == 3 * TABLE_BYTES
    assert d.expand([_ask("a", 5)])[0][0] == 6 and d.expand([_ask("b", 5)])[0][0] == 7
    # c learned nothing and drafts nothing: every template node empty
    assert d.expand([_ask("c", 5)]) == [[UNTOUCHED] * 7]
    d.learn([_teach("c", [5, 8])])
    assert d.tables_refused == 1  # counted once per request
    assert d.pristine.num_filled() == 0  # nobody learned in the start-up table
    d.remove_request("a")
    d.learn([_teach("c", [5, 8])])  # a table was freed: c gets one now
    assert d.expand([_ask("c", 5)])[0][0] == 8 and len(d.tables) == 3
    d.learn([_teach("e", [5, 9])])
    assert d.tables_refused == 2 and len(d.tables) == 3


def test_per_request_tables_are_capped_too_and_tenants_still_learn():
    d = _drafter(per_request_tables=True, max_request_tables=1)
    d.learn([_teach("a", [5, 6], "t"), _teach("b", [5, 7], "t")])
    # a's own table, the tenant's and the start-up one; b has none of its own
    assert len(d.tables) == 3 and d.tables_refused == 1
    assert d.expand([_ask("b", 5, "t")])[0][0] == UNTOUCHED
    # the tenant's table learned from both requests, the last one winning
    assert d.tenant_table("t").lookup(torch.tensor([5]))[0, 0] == 7


def test_no_cap_keeps_a_table_per_request():
    d = _drafter()
    d.learn([_teach(f"r{i}", [5, i + 10]) for i in range(5)])
    assert len(d.tables) == 6 and d.tables_refused == 0


def test_bad_max_request_tables_is_refused():
    with pytest.raises(ValueError, match="max_request_tables"):
        _drafter(max_request_tables=-1)


needs_arctic = pytest.mark.skipif(not suffix_cache.available(),
                                  reason="arctic-inference not installed")


def _respond(caches, rid: str, prompt: list[int], response: list[int], tenant="t"):
    """A request that generated ``response`` after ``prompt``, then left."""
    toks = np.array(prompt + response, dtype=np.int64)
    for n in range(len(prompt) + 1, len(toks) + 1):  # one token a step
        caches.sync(rid, tenant, toks[:n], len(prompt))
    caches.stop(rid)


def _follows(caches, rid: str, context: list[int], tenant="t") -> list[int]:
    toks = np.array(context, dtype=np.int64)
    caches.sync(rid, tenant, toks, len(toks))
    tree = caches.draft(rid, toks, 8, tree=False)
    caches.stop(rid)
    return [] if tree is None else tree.tokens


@needs_arctic
def test_cached_response_tokens_stay_under_max_cached_tokens():
    caches = suffix_cache.TenantSuffixCaches(max_tree_depth=8, max_cached_tokens=50)
    first = list(range(200, 230))  # 30 response tokens
    second = list(range(300, 330))
    _respond(caches, "r1", [1, 2, 3], first)
    assert caches.cached_tokens == 30 and caches.evicted_for_tokens == 0
    assert _follows(caches, "q1", [9, 200, 201, 202])[:3] == [203, 204, 205]
    _respond(caches, "r2", [1, 2, 3], second)
    # 60 tokens would not fit: the oldest response went when r2 passed 20
    assert caches.cached_tokens == 30 and caches.evicted_for_tokens == 1
    assert _follows(caches, "q2", [9, 200, 201, 202]) == []
    assert _follows(caches, "q3", [9, 300, 301, 302])[:3] == [303, 304, 305]


@needs_arctic
def test_a_running_response_longer_than_the_cap_leaves_the_global_tree():
    caches = suffix_cache.TenantSuffixCaches(max_tree_depth=8, max_cached_tokens=10)
    _respond(caches, "long", [1, 2], list(range(400, 420)))
    assert caches.cached_tokens == 0 and caches.cached == 0
    assert _follows(caches, "q", [9, 400, 401]) == []


@needs_arctic
def test_without_a_token_cap_responses_are_bounded_by_count_only():
    caches = suffix_cache.TenantSuffixCaches(max_tree_depth=8, max_cached_requests=2)
    for i in range(3):
        _respond(caches, f"r{i}", [1], list(range(500 + 40 * i, 530 + 40 * i)))
    assert caches.cached == 2 and caches.cached_tokens == 60
    assert caches.evicted_for_tokens == 0
