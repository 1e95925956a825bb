"""`recycle`: Token Recycling -- drafts from the target's own past top-k.

Every token the target verifies (prompt positions at prefill, every tree
node at decode, accepted or rejected) leaves its top-k next tokens in an
adjacency table; a static rank template expanded from the last token turns
that table into a draft tree. No draft model and no extra forward pass.
"""

from __future__ import annotations

import os
import time

import torch
from pydantic import Field, field_validator

from vllm_specplug.config import MethodConfig, SpecplugConfigError
from vllm_specplug.engine.adjacency import AdjacencyTable
from vllm_specplug.engine.interface import Needs, Proposer, ProposerContext, StepRequest
from vllm_specplug.engine.stats import RunningStat
from vllm_specplug.engine.template import TreeTemplate, parse_level_counts
from vllm_specplug.engine.tree import DraftTree


class RecycleConfig(MethodConfig):
    topk: int = Field(default=8, ge=1, le=16)
    """Successors kept per token in the adjacency table (its width); also the
    top-k the target reports per verified position. Templates only use
    ranks below it."""
    template: str = "default"
    """Draft-tree shape: a preset (``default`` = Graft's 80-node/9-level
    envelope, ``tr`` = Token Recycling's 80-node/6-level shape, ``graft_d0``,
    ``graft_d1``, ``graft_d5``) or nodes per level, e.g. ``"8,6,4,3,2"``.
    Drafts are its best-first prefix of ``num_speculative_tokens`` nodes."""
    table_path: str | None = None
    """Warm-start table written by ``specplug adjacency build`` (safetensors);
    None starts from an empty table that fills up from the prompts."""
    per_request_tables: bool = False
    """One table per request (each starts from the warm start), so requests
    never see each other's transitions; costs ``vocab * topk * 4`` bytes
    per running request and expands requests one at a time."""

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        parse_level_counts(value)
        return value

    def build_template(self) -> TreeTemplate:
        return TreeTemplate.from_spec(self.template, self.topk)

    def check_against(self, num_speculative_tokens: int) -> None:
        size = len(self.build_template())
        if num_speculative_tokens > size:
            raise SpecplugConfigError(
                f"speculative_config['num_speculative_tokens']={num_speculative_tokens} "
                f"exceeds the {size} nodes of template '{self.template}' "
                f"(topk={self.topk}) for method 'recycle'"
            )
        if self.table_path is not None and not os.path.isfile(self.table_path):
            raise SpecplugConfigError(
                f"speculative_config['table_path']: no such file {self.table_path!r}"
            )


    def check_engine(self, vllm_config) -> None:
        """Before the engine starts: the warm-start table's vocabulary is the
        target's (a table from another tokenizer is an error)."""
        if self.table_path is None:
            return
        vocab = vllm_config.model_config.get_vocab_size()
        try:
            meta = AdjacencyTable.read_header(self.table_path)
            if int(meta["vocab_size"]) != vocab:
                raise ValueError(
                    f"adjacency table {self.table_path} was built for a vocabulary of "
                    f"{meta['vocab_size']} tokens (model '{meta.get('model_id', '?')}'), "
                    f"but this model has {vocab}: rebuild it with `specplug adjacency build`")
        except (ValueError, KeyError) as e:
            raise SpecplugConfigError(f"speculative_config['table_path']: {e}") from None


class RecycleProposer(Proposer):
    name = "recycle"
    config_cls = RecycleConfig

    def __init__(self, config: RecycleConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        self.template = config.build_template()
        self.table = self._initial_table()
        self._own: dict[str, AdjacencyTable] = {}  # per_request_tables only
        self._update_time, self._expand_time = RunningStat(), RunningStat()

    def _initial_table(self) -> AdjacencyTable:
        cfg: RecycleConfig = self.config
        ctx = self.ctx
        model_id = os.path.basename(os.path.normpath(ctx.model_path)) if ctx.model_path else ""
        if cfg.table_path is None:
            return AdjacencyTable(ctx.vocab_size, cfg.topk, ctx.device, model_id)
        try:
            return AdjacencyTable.load(
                cfg.table_path, ctx.vocab_size, cfg.topk, ctx.device, model_id
            )
        except ValueError as e:
            raise SpecplugConfigError(f"speculative_config['table_path']: {e}") from None

    def needs(self) -> Needs:
        return Needs(topk=self.config.topk, prefill_topk=True, tree_topk=True)

    def add_request(self, req_id: str) -> None:
        if self.config.per_request_tables:
            self._own[req_id] = self.table.clone()

    def remove_request(self, req_id: str) -> None:
        self._own.pop(req_id, None)

    def _table_of(self, req_id: str) -> AdjacencyTable:
        if not self.config.per_request_tables:
            return self.table
        if req_id not in self._own:  # e.g. the runner skipped add_request
            self._own[req_id] = self.table.clone()
        return self._own[req_id]

    # ------------------------------------------------------------ learning
    def _rows(self, req: StepRequest) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tokens, top-k) rows a step taught us about one request."""
        toks, topk = [], []
        if req.node_tokens is not None and req.node_topk_ids is not None:
            toks.append(req.node_tokens.reshape(-1).long())
            topk.append(req.node_topk_ids.long())
        # At prefill the runner hands the prompt rows both ways: learn them once.
        same = req.topk_ids is req.node_topk_ids
        if req.topk_ids is not None and req.topk_ids.shape[0] and not same:
            # Row r follows token_ids[verified_pos + r]. These go last so the
            # accepted path -- the real context -- wins over a rejected
            # branch that happens to contain the same token.
            ids = req.token_ids[req.verified_pos : req.verified_pos + req.topk_ids.shape[0]]
            n = len(ids)
            toks.append(torch.as_tensor(ids, dtype=torch.long).to(req.topk_ids.device))
            topk.append(req.topk_ids[:n].long())
        return toks, topk

    def _learn(self, batch: list[StepRequest]) -> None:
        if self.config.per_request_tables:
            for req in batch:
                toks, topk = self._rows(req)
                if toks:
                    self._table_of(req.req_id).update(torch.cat(toks), torch.cat(topk))
            return
        # One update for the whole batch, in batch order (the same on every rank).
        toks, topk = [], []
        for req in batch:
            t, k = self._rows(req)
            toks += [x.to(self.table.device) for x in t]
            topk += [x.to(self.table.device) for x in k]
        if toks:
            self.table.update(torch.cat(toks), torch.cat(topk))

    # ------------------------------------------------------------ drafting
    def _expand(self, reqs: list[StepRequest]) -> list[list[int]]:
        roots = [req.last_token for req in reqs]
        if self.config.per_request_tables:
            return [
                self.template.expand(self._table_of(req.req_id), torch.tensor([root]))[0].tolist()
                for req, root in zip(reqs, roots)
            ]
        out = self.template.expand(self.table, torch.tensor(roots, dtype=torch.long))
        return out.cpu().tolist()  # the one host sync of the step

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        t0 = time.perf_counter()
        self._learn(batch)
        self._update_time.add(time.perf_counter() - t0)
        budget = self.ctx.num_speculative_tokens
        rooms = {
            i: min(budget, self.ctx.max_model_len - len(req.token_ids))
            for i, req in enumerate(batch)
            if req.sampled
        }
        live = [i for i, room in rooms.items() if room > 0]
        out: list[DraftTree | None] = [None] * len(batch)
        if not live:
            return out
        t0 = time.perf_counter()
        rows = self._expand([batch[i] for i in live])
        self._expand_time.add(time.perf_counter() - t0)
        for i, row in zip(live, rows):
            if batch[i].chain_only:
                tree = DraftTree.chain(self.template.chain_tokens(row, rooms[i]))
            else:
                # The whole template is expanded and dead nodes dropped before
                # cutting, so later template nodes fill slots whose branch
                # had no table entry.
                tree = self.template.to_draft_tree(row, rooms[i])
            out[i] = tree if len(tree) else None
        return out

    def stats(self) -> dict:
        """Table size and the per-step cost of its two operations (the
        update covers every request of the step, the expansion every live one)."""
        tables = [self.table, *self._own.values()]
        return {"table_bytes": sum(t.nbytes for t in tables), "tables": len(tables),
                "live_requests": len(self._own),
                "filled_rows": self.table.num_filled(),
                "update": self._update_time.as_ms(), "expand": self._expand_time.as_ms()}
