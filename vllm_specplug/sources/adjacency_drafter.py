"""Drafting from the target's own past top-k (Token Recycling; Graft's
retrieval side), as a piece any method can compose.

Every token the target verifies (prompt positions at prefill, every tree
node at decode, accepted or rejected) leaves its top-k next tokens in an
``AdjacencyTable``; a ``TreeTemplate`` expanded from a request's last token
turns that table into a draft tree. Needs ``Needs(topk=k,
prefill_topk=True, tree_topk=True)`` from the runner.
"""

from __future__ import annotations

import torch

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.adjacency import AdjacencyTable
from vllm_specplug.sources.template import TreeTemplate


class AdjacencyDrafter:
    """One shared table, learned from every step, and optionally one per
    running request (a copy of the shared one when it arrives, then updated
    with that request's own steps only)."""

    def __init__(self, table: AdjacencyTable, template: TreeTemplate,
                 per_request_tables: bool = False) -> None:
        self.table = table
        """The shared table (the warm start of per-request tables)."""
        self.template = template
        self.per_request_tables = per_request_tables
        self._own: dict[str, AdjacencyTable] = {}  # per_request_tables only

    @property
    def tables(self) -> list[AdjacencyTable]:
        return [self.table, *self._own.values()]

    def add_request(self, req_id: str) -> None:
        if self.per_request_tables:
            self._own[req_id] = self.table.clone()

    def remove_request(self, req_id: str) -> None:
        self._own.pop(req_id, None)

    def table_of(self, req_id: str) -> AdjacencyTable:
        if not self.per_request_tables:
            return self.table
        if req_id not in self._own:  # e.g. the runner skipped add_request
            self._own[req_id] = self.table.clone()
        return self._own[req_id]

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

    def learn(self, batch: list[StepRequest]) -> None:
        if self.per_request_tables:
            for req in batch:
                toks, topk = self.rows(req)
                if toks:
                    self.table_of(req.req_id).update(torch.cat(toks), torch.cat(topk))
        # The shared table learns from every request either way: it is the
        # start of the requests that arrive later (per_request_tables) or
        # the one table (otherwise). One update for the whole batch, in batch
        # order (the same on every rank).
        toks, topk = [], []
        for req in batch:
            t, k = self.rows(req)
            toks += [x.to(self.table.device) for x in t]
            topk += [x.to(self.table.device) for x in k]
        if toks:
            self.table.update(torch.cat(toks), torch.cat(topk))

    # ------------------------------------------------------------ drafting
    def expand(self, reqs: list[StepRequest]) -> list[list[int]]:
        """The whole template expanded from each request's last token."""
        roots = [req.last_token for req in reqs]
        if self.per_request_tables:
            return [
                self.template.expand(self.table_of(req.req_id), torch.tensor([root]))[0].tolist()
                for req, root in zip(reqs, roots)
            ]
        out = self.template.expand(self.table, torch.tensor(roots, dtype=torch.long))
        return out.cpu().tolist()  # the one host sync of the step

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
