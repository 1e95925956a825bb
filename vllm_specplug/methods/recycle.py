"""`recycle`: Token Recycling -- drafts from the target's own past top-k.

Every token the target verifies (prompt positions at prefill, every tree
node at decode, accepted or rejected) leaves its top-k next tokens in an
adjacency table; a static rank template expanded from the last token turns
that table into a draft tree. No draft model and no extra forward pass.
"""

from __future__ import annotations

import os
import time

from pydantic import Field, field_validator

from vllm_specplug.config import MethodConfig, option_error
from vllm_specplug.engine.interface import (
    Needs,
    Proposer,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.stats import RunningStat
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.adjacency import AdjacencyTable
from vllm_specplug.sources.adjacency_drafter import AdjacencyDrafter
from vllm_specplug.sources.template import TreeTemplate, parse_level_counts


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
            raise option_error(
                "num_speculative_tokens", f"exceeds the {size} nodes of template "
                f"'{self.template}' (topk={self.topk}) for method 'recycle'",
                num_speculative_tokens)
        if self.table_path is not None and not os.path.isfile(self.table_path):
            raise option_error("table_path", f"no such file {self.table_path!r}")


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
            raise option_error("table_path", str(e)) from None


class RecycleProposer(Proposer):
    name = "recycle"
    config_cls = RecycleConfig

    def __init__(self, config: RecycleConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        self.drafter = AdjacencyDrafter(self._initial_table(), config.build_template(),
                                        config.per_request_tables)
        self._update_time, self._expand_time = RunningStat(), RunningStat()

    @property
    def table(self) -> AdjacencyTable:
        return self.drafter.table

    @property
    def template(self) -> TreeTemplate:
        return self.drafter.template

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
            raise option_error("table_path", str(e)) from None

    def needs(self) -> Needs:
        return Needs(topk=self.config.topk, prefill_topk=True, tree_topk=True)

    def add_request(self, req_id: str) -> None:
        self.drafter.add_request(req_id)

    def remove_request(self, req_id: str) -> None:
        self.drafter.remove_request(req_id)

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        t0 = time.perf_counter()
        self.drafter.learn(batch)
        self._update_time.add(time.perf_counter() - t0)
        live = [i for i, req in enumerate(batch) if req.budget > 0]
        out: list[DraftTree | None] = [None] * len(batch)
        if not live:
            return out
        t0 = time.perf_counter()
        rows = self.drafter.expand([batch[i] for i in live])
        self._expand_time.add(time.perf_counter() - t0)
        for i, row in zip(live, rows):
            out[i] = self.drafter.tree(row, batch[i].budget, batch[i].chain_only)
        return out

    def stats(self) -> ProposerStats:
        """Table size and the per-step cost of its two operations (the
        update covers every request of the step, the expansion every live one)."""
        tables = self.drafter.tables
        return ProposerStats(gauges={
            "table_bytes": sum(t.nbytes for t in tables), "tables": len(tables),
            "live_requests": len(tables) - 1,  # per-request tables only
            "filled_rows": self.table.num_filled(),
            "update": self._update_time.as_ms(), "expand": self._expand_time.as_ms()})
