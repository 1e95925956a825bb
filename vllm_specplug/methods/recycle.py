"""`recycle`: Token Recycling -- drafts from the target's own past top-k.

Every token the target verifies (prompt positions at prefill, every tree
node at decode, accepted or rejected) leaves its top-k next tokens in an
adjacency table; a static rank template expanded from the last token turns
that table into a draft tree. No draft model and no extra forward pass.

When the context repeats (its last ``copy_min_match``+ tokens occurred
before, 1 by default), the continuation of that earlier occurrence -- ``pld``'s chain --
joins the tree as a long copy path: both carry per-node acceptance
estimates (the template's measured per-rank-path rates, the copy's learned
by match length in ``sources/copy_path.py``) and the merged tree is cut
best-first to the budget, so a confident copy takes the budget and the
template fills what it leaves.

At batch 8 the template alone accepts fewer tokens per step than at
batch 1: requests that start together find fewer warm rows (at batch 1
each request drafts from rows the earlier, finished requests left), which
the copy path makes up for on repeating text.
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
from vllm_specplug.engine.tree import DraftTree, normalize_tree
from vllm_specplug.sources.adjacency import AdjacencyTable
from vllm_specplug.sources.adjacency_drafter import AdjacencyDrafter
from vllm_specplug.sources.copy_path import CopyConfidence, accepted_prefix
from vllm_specplug.sources.ngram import match
from vllm_specplug.sources.template import MEASURED, TreeTemplate, parse_level_counts


def auto_template(num_speculative_tokens: int) -> str:
    """``template="auto"``: the smallest measured preset holding the budget
    (``m8``, ``m16``), else Graft's 80-node envelope."""
    for name in sorted(MEASURED, key=lambda n: len(MEASURED[n])):
        if len(MEASURED[name]) >= num_speculative_tokens:
            return name
    return "default"


class RecycleConfig(MethodConfig):
    topk: int = Field(default=8, ge=1, le=16)
    """Successors kept per token in the adjacency table (its width); also the
    top-k the target reports per verified position. Templates only use
    ranks below it."""
    template: str = "auto"
    """Draft-tree shape: ``auto`` (the measured small-budget preset that
    holds ``num_speculative_tokens``: ``m8`` up to 8 nodes, ``m16`` up to
    16, else ``default``), a measured preset (``m8``, ``m16``: the rank
    paths the reference model's answers followed most often, see
    ``sources/template.py``), a level-count preset (``default`` = Graft's
    80-node/9-level envelope, ``tr`` = Token Recycling's 80-node/6-level
    shape, ``graft_d0``, ``graft_d1``, ``graft_d5``) or nodes per level,
    e.g. ``"8,6,4,3,2"``. Drafts are its best-first prefix of
    ``num_speculative_tokens`` nodes (with the copy path, cut by score)."""
    copy_path: bool = True
    """Add the context's copy path (longest suffix match, ``pld``'s chain)
    when the context repeats; it and the template are cut best-first by
    their per-node acceptance estimates."""
    copy_min_match: int = Field(default=1, ge=1, le=64)
    """Shortest suffix match (tokens) that counts as the context repeating
    (1, as ``pld``: a one-token match's copy is scored low, so it only
    keeps the nodes the template would fill worse; with 2, `recycle`
    accepts fewer tokens than `pld` on translation)."""
    copy_max_match: int = Field(default=4, ge=1, le=64)
    """Longest suffix looked up for the copy path."""
    table_path: str | None = None
    """Warm-start table written by ``specplug adjacency build`` (safetensors);
    None starts from an empty table that fills up from the prompts."""
    per_request_tables: bool = False
    """Each running request drafts from its own table: a copy of its
    tenant's table (the requests with its ``cache_salt``, see ``isolation``)
    taken at its first step, then updated with its own steps only (the
    tenant's table learns from all of them, for the ones that come later).
    False (the default): the requests of a tenant share its table. Per-request
    tables accept no more at batch 4-8 than the shared table, whose rows
    from concurrent requests help about as often as they overwrite, and
    they cost ``vocab * topk * 4`` bytes per running request (1.5 MiB for
    the reference model) and expand requests one at a time. A request
    without a tenant (isolation ``strict``) always has its own table, a copy
    of the start-up one."""
    max_tenants: int = Field(default=64, ge=1)
    """Tenants whose learned adjacency table is kept (least recently used
    first out; a tenant with a running request goes last). Each table is
    ``vocab * topk`` int32 on the engine's device: 1.5 MiB for the
    reference model at ``topk=8``, 4 MiB for a 128k vocabulary, so 96 MiB or
    256 MiB at the default 64. An evicted tenant starts again from the
    start-up table."""
    max_request_tables: int | None = Field(default=256, ge=0)
    """Running requests that may hold an adjacency table of their own (with
    ``per_request_tables``, or without a tenant under isolation
    ``strict``), each ``vocab * topk`` int32 like a tenant's: 384 MiB for
    the reference model at the default, 1 GiB for a 128k vocabulary. A
    request that starts while all are taken drafts only its copy path
    until a table is freed (counted as ``tables_refused``). None: no
    bound."""

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        if value.strip() != "auto":
            parse_level_counts(value)
        return value

    def build_template(self, num_speculative_tokens: int | None = None) -> TreeTemplate:
        """The template (``auto`` resolved for the budget; ``default``
        without one)."""
        spec = self.template
        if spec.strip() == "auto":
            spec = auto_template(num_speculative_tokens) if num_speculative_tokens else "default"
        return TreeTemplate.from_spec(spec, self.topk)

    def check_against(self, num_speculative_tokens: int) -> None:
        if self.copy_min_match > self.copy_max_match:
            raise option_error("copy_min_match",
                               f"must be <= copy_max_match={self.copy_max_match}",
                               self.copy_min_match)
        try:  # a template file's ranks must lie below topk
            size = len(self.build_template(num_speculative_tokens))
        except ValueError as e:
            raise option_error("template", str(e)) from None
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
        try:
            AdjacencyTable.check_vocab(self.table_path,
                                       vllm_config.model_config.get_vocab_size())
        except (ValueError, KeyError) as e:
            raise option_error("table_path", str(e)) from None


class RecycleProposer(Proposer):
    name = "recycle"
    remembers_outputs = True  # a tenant's adjacency table
    tenant_aware = True  # one table per tenant (AdjacencyDrafter)
    config_cls = RecycleConfig

    def __init__(self, config: RecycleConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        self.drafter = AdjacencyDrafter(
            self._initial_table(), config.build_template(ctx.num_speculative_tokens),
            config.per_request_tables, config.max_tenants, config.max_request_tables)
        self._update_time, self._expand_time = RunningStat(), RunningStat()
        self.copy = CopyConfidence(config.copy_max_match)
        # req_id -> (history length, copy tokens in the tree, match length)
        self._pending: dict[str, tuple[int, list[int], int]] = {}

    @property
    def template(self) -> TreeTemplate:
        return self.drafter.template

    def _initial_table(self) -> AdjacencyTable:
        cfg, ctx = self.config, self.ctx
        try:
            return AdjacencyTable.for_target(cfg.table_path, ctx.vocab_size, cfg.topk,
                                             ctx.device, ctx.model_path)
        except ValueError as e:
            raise option_error("table_path", str(e)) from None

    def needs(self) -> Needs:
        return Needs(topk=self.config.topk, prefill_topk=True, tree_topk=True,
                     topk_probs=False)

    def add_request(self, req_id: str) -> None:
        self.drafter.add_request(req_id)

    def remove_request(self, req_id: str) -> None:
        self.drafter.remove_request(req_id)
        self._pending.pop(req_id, None)

    def _feedback(self, req: StepRequest) -> None:
        """Teach the copy estimate what the target did with the last copy."""
        pending = self._pending.pop(req.req_id, None)
        if pending is None or req.draft_kept <= 0:
            return
        base, copy, n = pending
        verified = min(len(copy), req.draft_kept)
        truth = req.token_ids[base : len(req.token_ids) - 1]
        self.copy.record(n, verified, accepted_prefix(copy[:verified], truth))

    def _tree(self, req: StepRequest, row: list[int]) -> DraftTree | None:
        """The template's tree, merged with the copy path when the context
        repeats, cut best-first to the request's budget."""
        cfg: RecycleConfig = self.config
        budget = req.budget
        copy: list[int] = []
        n = 0
        if cfg.copy_path:
            n, begins = match(req.token_ids, cfg.copy_min_match, cfg.copy_max_match)
            if n:
                copy = req.token_ids[begins[0] : begins[0] + budget].tolist()
        if not copy:
            return self.drafter.tree(row, budget, req.chain_only)
        if req.chain_only:
            tree = DraftTree.chain(copy)
        else:
            tmpl = self.template.to_draft_tree(row, budget)
            if tmpl.scores is None:  # a template without scores ranks below the copy
                tmpl.scores = [0.0] * len(tmpl)
            offset = len(copy)
            tree = normalize_tree(DraftTree(
                copy + tmpl.tokens,
                list(range(-1, offset - 1)) + [p + offset if p >= 0 else -1
                                               for p in tmpl.parents],
                self.copy.scores(n, offset) + list(tmpl.scores)), budget)
        kept = 0  # copy nodes lead the kept order
        while (kept < min(len(tree), len(copy)) and tree.parents[kept] == kept - 1
               and tree.tokens[kept] == copy[kept]):
            kept += 1
        self._pending[req.req_id] = (len(req.token_ids), copy[:kept], n)
        return tree

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        for req in batch:
            self._feedback(req)
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
            out[i] = self._tree(batch[i], row)
        return out

    def stats(self) -> ProposerStats:
        """Tables held (the start-up one, the tenants', the requests' own),
        requests refused one of their own, the most-filled table's rows, and
        the per-step cost of the two operations (the update covers every
        request of the step, the expansion every live one)."""
        tables = self.drafter.tables
        gauges = {
            "table_bytes": sum(t.nbytes for t in tables), "tables": len(tables),
            "tenants": self.drafter.num_tenants, "live_requests": self.drafter.num_requests,
            "filled_rows": max(t.num_filled() for t in tables), **self.copy.snapshot(),
            "update": self._update_time.as_ms(), "expand": self._expand_time.as_ms()}
        return ProposerStats(counters={"tables_refused": self.drafter.tables_refused},
                             gauges=gauges)
