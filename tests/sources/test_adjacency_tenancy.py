"""Adjacency tables by tenant (``sources/adjacency_drafter.py``, used by
`recycle` and `graft`): a tenant drafts only from its own requests' steps
and the start-up table, a request without a tenant only from its own steps
and the start-up table, and the start-up table itself never learns."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.sources.adjacency import UNTOUCHED, AdjacencyTable
from vllm_specplug.sources.adjacency_drafter import AdjacencyDrafter
from vllm_specplug.sources.template import TreeTemplate

VOCAB, K = 100, 4
A, B = "t:aaaa", "t:bbbb"
WARM = (9, 3)  # the start-up table knows 3 follows 9


def _drafter(**kw) -> AdjacencyDrafter:
    warm = AdjacencyTable(VOCAB, K)
    warm.update(torch.tensor([WARM[0]]), torch.tensor([[WARM[1], 60, 61, 62]]))
    return AdjacencyDrafter(warm, TreeTemplate.from_spec("4,2,1", K), **kw)


def _teach(req_id: str, tenant: str | None, seq: list[int]) -> StepRequest:
    """A prompt step whose top-k says each token is followed by the next."""
    topk = torch.tensor([[seq[i + 1], 70, 71, 72] for i in range(len(seq) - 1)])
    return StepRequest(req_id, np.array(seq), len(seq) - 1, False, 0,
                       topk_ids=topk, tenant=tenant)


def _ask(req_id: str, tenant: str | None, last: int) -> StepRequest:
    return StepRequest(req_id, np.array([1, last]), 1, True, 1, tenant=tenant)


def _first(drafter: AdjacencyDrafter, req: StepRequest) -> int:
    """The rank-0 child of the request's last token (template node 0)."""
    return drafter.expand([req])[0][0]


def test_a_tenant_learns_alone_and_the_start_up_table_stays_pristine():
    d = _drafter()
    start = d.pristine.table.clone()
    d.learn([_teach("a1", A, [5, 6, 7])])
    d.remove_request("a1")
    assert torch.equal(d.pristine.table, start)
    # B's table is the start-up one: the warm row, none of A's
    assert torch.equal(d.tenant_table(B).table, start)
    assert _first(d, _ask("b1", B, 5)) == UNTOUCHED and _first(d, _ask("b1", B, 9)) == 3
    # A's next request drafts from what A's first one taught
    assert _first(d, _ask("a2", A, 5)) == 6 and _first(d, _ask("a2", A, 6)) == 7
    assert _first(d, _ask("a2", A, 9)) == 3
    # no tenant: the start-up table only
    assert _first(d, _ask("n1", None, 5)) == UNTOUCHED and _first(d, _ask("n1", None, 9)) == 3


def test_a_request_without_tenant_learns_in_its_own_table_freed_at_remove():
    d = _drafter()
    d.learn([_teach("n1", None, [5, 6])])
    assert _first(d, _ask("n1", None, 5)) == 6  # its own steps help it
    assert _first(d, _ask("n2", None, 5)) == UNTOUCHED  # not another private one
    assert _first(d, _ask("p1", "public", 5)) == UNTOUCHED  # nor the public pool
    assert d.num_tenants == 1 and len(d.tables) == 4  # pristine, public, n1, n2
    for rid in ("n1", "n2", "p1"):
        d.remove_request(rid)
    assert d.num_requests == 0 and len(d.tables) == 2  # the public pool stays


def test_one_batch_of_two_tenants_learns_per_tenant_in_batch_order():
    d = _drafter()
    # A says 5 -> 6 then, later in the batch, 5 -> 8; B says 5 -> 7
    d.learn([_teach("a1", A, [5, 6]), _teach("b1", B, [5, 7]), _teach("a2", A, [5, 8])])
    rows = d.expand([_ask("a1", A, 5), _ask("b1", B, 5), _ask("a2", A, 5)])
    assert [r[0] for r in rows] == [8, 7, 8]


def test_per_request_tables_start_from_their_own_tenant():
    d = _drafter(per_request_tables=True)
    d.learn([_teach("a1", A, [5, 6])])
    assert _first(d, _ask("a1", A, 5)) == 6
    # a later request of A starts from A's table, which learned a1's rows
    assert _first(d, _ask("a2", A, 5)) == 6
    assert _first(d, _ask("b1", B, 5)) == UNTOUCHED
    # a1's rows after a2 took its copy reach A's table, not a2's
    d.learn([_teach("a1", A, [11, 12])])
    assert _first(d, _ask("a2", A, 11)) == UNTOUCHED
    assert _first(d, _ask("a3", A, 11)) == 12


def test_tenant_tables_are_bounded_and_a_running_tenant_goes_last():
    d = _drafter(max_tenants=2)
    d.learn([_teach("a1", A, [5, 6])])  # a1 keeps running
    d.learn([_teach("b1", B, [5, 7])])
    d.remove_request("b1")
    d.learn([_teach("c1", "t:cccc", [5, 8])])  # a third tenant: B (idle) goes, not A
    assert d.num_tenants == 2
    assert _first(d, _ask("a1", A, 5)) == 6
    assert _first(d, _ask("b2", B, 5)) == UNTOUCHED  # B starts again from the start-up table
    assert _first(d, _ask("b2", B, 9)) == 3
