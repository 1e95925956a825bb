"""Drafting from the target's own past top-k (Token Recycling; Graft's
retrieval side), as a piece any method can compose.

Every token the target verifies (prompt positions at prefill, every tree
node at decode, accepted or rejected) leaves its top-k next tokens in an
``AdjacencyTable``; a ``TreeTemplate`` expanded from a request's last token
turns that table into a draft tree. Needs ``Needs(topk=k,
prefill_topk=True, tree_topk=True, topk_probs=False)`` from the runner (the
table keeps ids only). Tables are kept per tenant, so requests learn from
and draft from only their own tenant's steps.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.adjacency import AdjacencyTable
from vllm_specplug.sources.template import TreeTemplate

logger = logging.getLogger(__name__)


class AdjacencyDrafter:
    """Adjacency tables by tenant (:mod:`vllm_specplug.tenancy`).

    The start-up table (a ``table_path`` warm start, or an empty one) stays
    ``pristine``: it holds no request's text. Each tenant learns in its own
    copy of it, so a request drafts only from its own tenant's past steps;
    at most ``max_tenants`` copies are kept, least recently used first out.
    A request without a tenant (isolation ``strict``, or untagged) learns in
    a copy of its own, freed when it ends. With ``per_request_tables``,
    every running request drafts from its own copy of its tenant's table
    (taken when it first steps, then updated with its own steps only) while
    the tenant's table still learns from all of them, for the requests that
    come later.

    Memory: every table is the same ``vocab * k`` int32, and at most
    ``1 + max_tenants + max_request_tables`` are held. A request that needs
    a table of its own while ``max_request_tables`` are taken gets none
    until one is freed: it learns nothing and drafts nothing from the table
    (counted as ``tables_refused``), and is verified as usual."""

    def __init__(self, table: AdjacencyTable, template: TreeTemplate,
                 per_request_tables: bool = False, max_tenants: int = 64,
                 max_request_tables: int | None = None) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        if max_request_tables is not None and max_request_tables < 0:
            raise ValueError(f"max_request_tables must be >= 0, got {max_request_tables}")
        self.pristine = table
        """The start-up table: every tenant's and every private table's start."""
        self.template = template
        self.per_request_tables = per_request_tables
        self.max_tenants = max_tenants
        self._tenant_tables: OrderedDict[str, AdjacencyTable] = OrderedDict()  # LRU order
        self._own: dict[str, AdjacencyTable] = {}  # per-request tables
        self._tenant: dict[str, str | None] = {}  # req_id -> tenant, from its first step
        self.max_request_tables = max_request_tables
        self._refused: set[str] = set()  # running requests refused a table of their own
        self.tables_refused = 0
        """Requests that were refused a table of their own (each counted once)."""
        most = 1 + max_tenants + (max_request_tables if max_request_tables is not None else 0)
        logger.info("specplug: adjacency tables of %.1f MiB each, at most %d held%s",
                    table.nbytes / 2**20, most,
                    "" if max_request_tables is not None else ", plus one per running request")

    @property
    def tables(self) -> list[AdjacencyTable]:
        """Every table held: the pristine one, the tenants', the requests' own."""
        return [self.pristine, *self._tenant_tables.values(), *self._own.values()]

    @property
    def num_tenants(self) -> int:
        return len(self._tenant_tables)

    @property
    def num_requests(self) -> int:
        """Requests seen and not removed yet."""
        return len(self._tenant)

    def add_request(self, req_id: str) -> None:
        """Nothing yet: the request's tenant arrives with its first step."""

    def remove_request(self, req_id: str) -> None:
        self._own.pop(req_id, None)
        self._tenant.pop(req_id, None)
        self._refused.discard(req_id)

    # ------------------------------------------------------------ tables
    def tenant_table(self, tenant: str) -> AdjacencyTable:
        """The tenant's learned table (a copy of the pristine one the first
        time, or again after it was evicted)."""
        table = self._tenant_tables.get(tenant)
        if table is not None:
            self._tenant_tables.move_to_end(tenant)
            return table
        self._evict_for_one_more()
        table = self._tenant_tables[tenant] = self.pristine.clone()
        return table

    def _evict_for_one_more(self) -> None:
        """Make room under ``max_tenants``: the least recently used tenant
        without a running request goes first; only when every kept tenant has
        one does a running tenant lose its table (its requests go on from a
        fresh copy: fewer accepted tokens, never a wrong one)."""
        while len(self._tenant_tables) >= self.max_tenants:
            running = set(self._tenant.values())
            idle = next((t for t in self._tenant_tables if t not in running), None)
            del self._tenant_tables[idle if idle is not None
                                    else next(iter(self._tenant_tables))]

    def _bind(self, req: StepRequest) -> str | None:
        """The request's tenant, remembered for ``remove_request`` (which
        gets only the id). A tenant that changes mid-request drops the
        request's own table: it was a copy of the other tenant's."""
        if req.req_id in self._tenant and self._tenant[req.req_id] != req.tenant:
            self._own.pop(req.req_id, None)
        self._tenant[req.req_id] = req.tenant
        return req.tenant

    def table_of(self, req: StepRequest) -> AdjacencyTable | None:
        """The table ``req`` drafts from and learns in; None when it needs
        one of its own and ``max_request_tables`` are taken."""
        tenant = self._bind(req)
        if tenant is not None and not self.per_request_tables:
            return self.tenant_table(tenant)
        own = self._own.get(req.req_id)
        if own is None:
            if not self._room_for_own(req.req_id):
                return None
            start = self.pristine if tenant is None else self.tenant_table(tenant)
            own = self._own[req.req_id] = start.clone()
        return own

    def _room_for_own(self, req_id: str) -> bool:
        """A request's own table fits under ``max_request_tables``; a
        refusal is counted once per request, and logged once."""
        if self.max_request_tables is None or len(self._own) < self.max_request_tables:
            self._refused.discard(req_id)
            return True
        if req_id not in self._refused:
            self._refused.add(req_id)
            if not self.tables_refused:
                logger.warning("specplug: %d requests hold an adjacency table of their own "
                               "(max_request_tables); later ones draft without one until a "
                               "table is freed (counted as tables_refused; logged once)",
                               len(self._own))
            self.tables_refused += 1
        return False

    @staticmethod
    def _by_table(tables: list[AdjacencyTable | None]) -> list[tuple[AdjacencyTable,
                                                                      list[int]]]:
        """Batch indices grouped by the table they use, in batch order
        within a group (the same on every rank); requests without a table
        are left out."""
        groups: dict[int, tuple[AdjacencyTable, list[int]]] = {}
        for i, table in enumerate(tables):
            if table is not None:
                groups.setdefault(id(table), (table, []))[1].append(i)
        return list(groups.values())

    # ------------------------------------------------------------ learning
    @staticmethod
    def rows(req: StepRequest) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tokens, top-k) rows a step taught us about one request."""
        toks, topk = [], []
        if req.node_tokens is not None and req.node_topk_ids is not None:
            toks.append(req.node_tokens.reshape(-1).long())
            topk.append(req.node_topk_ids.long())
        # At prefill the runner hands the prompt rows both ways: learn them once.
        same = req.topk_ids is req.node_topk_ids
        if req.topk_ids is not None and req.topk_ids.shape[0] and not same:
            # Row r follows token_ids[verified_pos + topk_offset + r]. These
            # go last so the accepted path -- the real context -- wins over
            # a rejected branch that happens to contain the same token.
            at = req.verified_pos + req.topk_offset
            ids = req.token_ids[at : at + req.topk_ids.shape[0]]
            n = len(ids)
            toks.append(torch.as_tensor(ids, dtype=torch.long).to(req.topk_ids.device))
            topk.append(req.topk_ids[:n].long())
        return toks, topk

    def _update(self, table: AdjacencyTable, rows: list[tuple[list, list]]) -> None:
        """One update of ``table`` with the rows of several requests, in order."""
        toks = [x.to(table.device) for t, _ in rows for x in t]
        topk = [x.to(table.device) for _, k in rows for x in k]
        if toks:
            table.update(torch.cat(toks), torch.cat(topk))

    def learn(self, batch: list[StepRequest]) -> None:
        """Each table learns from the rows of the requests that use it: one
        update per table, in batch order."""
        rows = [self.rows(req) for req in batch]
        # Every table is looked up before any learns: a request's new own
        # table starts from what its tenant knew before this step.
        tables = [self.table_of(req) for req in batch]
        for table, idx in self._by_table(tables):
            self._update(table, [rows[i] for i in idx])
        if self.per_request_tables:
            # The tenant's table learns from all its requests, for later ones.
            shared = [self.tenant_table(req.tenant) if req.tenant is not None else None
                      for req in batch]
            for table, idx in self._by_table(shared):
                if table is not None:
                    self._update(table, [rows[i] for i in idx])

    # ------------------------------------------------------------ drafting
    def expand(self, reqs: list[StepRequest],
               template: TreeTemplate | None = None) -> list[list[int]]:
        """``template`` (the drafter's own by default) expanded from each
        request's last token through the request's table: one expansion,
        and one host sync, per table."""
        template = self.template if template is None else template
        out: list[list[int]] = [[-1] * len(template) for _ in reqs]  # no table: no tokens
        for table, idx in self._by_table([self.table_of(req) for req in reqs]):
            roots = torch.tensor([reqs[i].last_token for i in idx], dtype=torch.long)
            for i, row in zip(idx, template.expand(table, roots).cpu().tolist()):
                out[i] = row
        return out

    def tree(self, row: list[int], budget: int, chain_only: bool) -> DraftTree | None:
        """An expanded row as a draft tree of at most ``budget`` nodes."""
        if chain_only:
            tree = DraftTree.chain(self.template.chain_tokens(row, budget))
        else:
            # The whole template is expanded and dead nodes dropped before
            # cutting, so later template nodes fill slots whose branch had
            # no table entry.
            tree = self.template.to_draft_tree(row, budget)
        return tree if len(tree) else None
