"""`graft`: "draft less, retrieve more" (Graft, section 3 and Algorithms 1-2).

The EAGLE-3 head drafts a dynamic tree as in ``eagle3_tree``, tracking the
best cumulative path score per depth. At a few calibrated checkpoints (d0:
after the root step, d1: after the first expansion, d5: after the fifth) the
confidence ``c_d = exp(max_j S_{d,j})`` (Eq. 5-6) is compared with a
threshold; at the first checkpoint where ``c_d <= tau_d`` (Eq. 7) expansion
stops -- fewer head passes is where the time is saved -- and the fixed budget
``K_max`` splits into the best ``K_draft`` draft nodes and a retrieval branch
(Eq. 8/13; 8/52, 24/36, 40/20 of 60, scaled to other budgets). The
retrieval branch is the stage's rank template (Table 7) expanded from the
current token through the token adjacency table ``recycle`` keeps (Eq. 9-10,
15), learned from the target's top-k at every verified node and the prompt
(Eq. 12/14) by the same code (``sources/adjacency_drafter.py``). Both merge
into one trie, so a retrieved continuation of a token the head also drafted
hangs under the head's node; the stage template is followed by the full
envelope until the tree has ``K_max`` nodes.

Thresholds: Table 11's values unless ``calibration`` names a file written
by ``specplug graft calibrate`` (``methods/graft_calibrate.py``), which also
uses this method's ``record`` option to log what each stage would have
earned.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from vllm_specplug.config import option_error
from vllm_specplug.engine.interface import (
    Needs,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.stats import RunningStat
from vllm_specplug.engine.tree import DraftTree, TrieBuilder, normalize_tree
from vllm_specplug.sources.adjacency import AdjacencyTable
from vllm_specplug.sources.adjacency_drafter import AdjacencyDrafter
from vllm_specplug.sources.eagle3_drafter import Eagle3Drafter, Eagle3DrafterConfig
from vllm_specplug.sources.template import TreeTemplate, parse_level_counts

PAPER_BUDGET = 60
RETRIEVAL = "adjacency"


class GraftConfig(Eagle3DrafterConfig):
    checkpoints: list[int] = [0, 1, 5]
    """Pruning checkpoints, as head expansions done before the check (the
    paper's d0, d1, d5: after the root step, after the first and the fifth
    expansion); increasing, below ``depth``."""
    thresholds: list[float] = [0.14, 0.14, 0.49]
    """``tau_d`` per checkpoint (Table 11's mean across tasks); the tree is
    pruned at the first checkpoint with ``c_d <= tau_d``. Replaced by the
    file of ``calibration``."""
    calibration: str | None = None
    """JSON written by ``specplug graft calibrate`` (checkpoints and
    thresholds fitted on this head and this machine's step costs)."""
    draft_nodes: list[int] = [8, 24, 40]
    """Draft nodes kept when pruned at each checkpoint, out of a 60-node
    budget (Eq. 8/13); other budgets scale them proportionally."""
    templates: list[str] = ["graft_d0", "graft_d1", "graft_d5"]
    """Retrieval template per checkpoint (Table 7's nodes per level, or a
    preset of ``sources/template.py``); the full envelope ``default`` fills
    slots they leave (dead table rows, nodes unified with the draft)."""
    adjacency_topk: int = Field(default=8, ge=1, le=16)
    """Successors per token in the adjacency table (and the top-k the target
    reports per verified node)."""
    table_path: str | None = None
    """Warm-start table from ``specplug adjacency build`` (the paper's
    warm-up); None starts empty and learns from prompts and steps."""
    max_tenants: int = Field(default=64, ge=1)
    """Tenants (requests sharing a ``cache_salt``, see ``isolation``) whose
    learned adjacency table is kept, least recently used first out (a
    tenant with a running request goes last). Each table is ``vocab *
    adjacency_topk`` int32 on the engine's device: 1.5 MiB for the
    reference model at 8, 4 MiB for a 128k vocabulary, so 96 MiB or 256 MiB
    at the default 64. A request without a tenant (isolation ``strict``)
    learns in a table of its own while it runs. An evicted tenant starts
    again from the start-up table."""
    max_request_tables: int | None = Field(default=256, ge=0)
    """Running requests without a tenant (isolation ``strict``) that may
    hold an adjacency table of their own, each ``vocab * adjacency_topk``
    int32: 384 MiB for the reference model at the default. A request that
    starts while all are taken drafts with the head alone (no retrieval
    branch) until a table is freed (counted as ``tables_refused``). None:
    no bound."""
    ablation: Literal["none", "no_retrieval", "no_pruning"] = "none"
    """Fig. 5's ablations: ``no_retrieval`` prunes but leaves the freed slots
    empty; ``no_pruning`` never stops the head and always uses the split of
    checkpoint ``fixed_stage`` (retrieval at a fixed share)."""
    fixed_stage: int = Field(default=1, ge=0)
    """Which checkpoint's split ``ablation='no_pruning'`` uses."""
    record: str | None = None
    """Calibration only: append one JSON line per drafted step with the
    checkpoint confidences and the accepted length each stage's tree would
    have had (the head is never stopped). Written by ``graft calibrate``
    (one engine, tensor parallel size 1: every rank would write)."""

    @model_validator(mode="after")
    def _consistent(self) -> GraftConfig:
        if self.calibration is not None:
            self._load_calibration()
        n = len(self.checkpoints)
        if not (len(self.thresholds) == len(self.draft_nodes) == len(self.templates) == n):
            raise option_error("checkpoints", "checkpoints, thresholds, draft_nodes and "
                               f"templates need one entry each (got {n}, "
                               f"{len(self.thresholds)}, {len(self.draft_nodes)}, "
                               f"{len(self.templates)})")
        if n == 0 or any(b <= a for a, b in zip(self.checkpoints, self.checkpoints[1:])) \
                or self.checkpoints[0] < 0 or self.checkpoints[-1] >= self.depth:
            raise option_error("checkpoints", f"must be increasing within 0..depth-1 "
                               f"(depth={self.depth})", self.checkpoints)
        if any(not 0.0 <= t <= 1.0 for t in self.thresholds):
            raise option_error("thresholds", "confidences are probabilities: each "
                               "threshold must lie in [0, 1]", self.thresholds)
        if any(not 1 <= k < PAPER_BUDGET for k in self.draft_nodes):
            raise option_error("draft_nodes", f"each must be in 1..{PAPER_BUDGET - 1} "
                               f"(of a {PAPER_BUDGET}-node budget)", self.draft_nodes)
        for t in self.templates:
            try:
                parse_level_counts(t)
            except ValueError as e:
                raise option_error("templates", str(e)) from None
        if self.fixed_stage >= n:
            raise option_error("fixed_stage", f"must name one of the {n} checkpoints",
                               self.fixed_stage)
        return self

    def _load_calibration(self) -> None:
        try:
            with open(self.calibration) as f:
                cal = json.load(f)
            checkpoints, thresholds = list(cal["checkpoints"]), list(cal["thresholds"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise option_error("calibration", f"cannot read a graft calibration from "
                               f"{self.calibration!r}: {e}") from None
        object.__setattr__(self, "checkpoints", [int(c) for c in checkpoints])
        object.__setattr__(self, "thresholds", [float(t) for t in thresholds])

    def check_against(self, num_speculative_tokens: int) -> None:
        super().check_against(num_speculative_tokens)
        try:  # a template file's ranks must lie below adjacency_topk
            self.build_stage_templates()
        except ValueError as e:
            raise option_error("templates", str(e)) from None
        if self.table_path is not None and not os.path.isfile(self.table_path):
            raise option_error("table_path", f"no such file {self.table_path!r}")

    def build_stage_templates(self) -> list[TreeTemplate]:
        """One retrieval template per checkpoint, ranks below ``adjacency_topk``."""
        return [TreeTemplate.from_spec(t, self.adjacency_topk) for t in self.templates]

    def check_engine(self, vllm_config) -> None:
        """Before the engine starts: the warm-start table's vocabulary is the
        target's."""
        if self.table_path is not None:
            try:
                AdjacencyTable.check_vocab(self.table_path,
                                           vllm_config.model_config.get_vocab_size())
            except ValueError as e:
                raise option_error("table_path", str(e)) from None

    def draft_budget(self, stage: int, budget: int) -> int:
        """Draft nodes kept at ``stage`` (index into checkpoints) for a
        tree of ``budget`` nodes: Eq. 8's split scaled from 60 nodes."""
        return max(1, min(budget, round(self.draft_nodes[stage] * budget / PAPER_BUDGET)))


class GraftProposer(Eagle3Drafter):
    name = "graft"
    remembers_outputs = True  # a tenant's adjacency table learns from every verified node
    tenant_aware = True  # adjacency tables and head prefix store keyed by tenant
    config_cls = GraftConfig

    def __init__(self, config: GraftConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        k = config.adjacency_topk
        self.adjacency = AdjacencyDrafter(self._initial_table(config, ctx),
                                          TreeTemplate.from_spec("default", k),
                                          max_tenants=config.max_tenants,
                                          max_request_tables=config.max_request_tables)
        self.stage_templates = config.build_stage_templates()
        n = len(config.checkpoints)
        self.stage_steps = [0] * (n + 1)  # pruned at checkpoint i; last: never pruned
        self.tree_nodes = {"draft": 0, RETRIEVAL: 0}
        self._graft_time = RunningStat()
        self._recorder = _Recorder(config.record) if config.record else None

    @staticmethod
    def _initial_table(config: GraftConfig, ctx: ProposerContext) -> AdjacencyTable:
        try:
            return AdjacencyTable.for_target(config.table_path, ctx.vocab_size,
                                             config.adjacency_topk, ctx.device, ctx.model_path)
        except ValueError as e:
            raise option_error("table_path", str(e)) from None

    def needs(self) -> Needs:
        return Needs(aux_layers=self.aux_layers, topk=self.config.adjacency_topk,
                     prefill_topk=True, tree_topk=True, topk_probs=False)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.adjacency.remove_request(req_id)
        if self._recorder is not None:
            self._recorder.finish(req_id)

    # ------------------------------------------------------------ drafting
    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        cfg: GraftConfig = self.config
        self.adjacency.learn(batch)  # Eq. 12/14: every verified node, accepted or not
        self.extend(batch)
        if self._recorder is not None:
            self._recorder.observe(batch)
        budgets = [r.budget if r.sampled and self.runtime.ready(r.req_id, len(r.token_ids))
                   else 0 for r in batch]
        live = [i for i, b in enumerate(budgets) if b > 0]
        out: list[DraftTree | None] = [None] * len(batch)
        if not live:
            return out
        gate = _Gate(cfg, len(live), stop=cfg.ablation != "no_pruning"
                     and self._recorder is None)
        trees = self.draft(batch, budgets, hook=gate)
        t0 = time.perf_counter()
        # each request's retrieval rows come from its own tenant's table
        live_reqs = [batch[i] for i in live]
        rows = {id(t): self.adjacency.expand(live_reqs, t)
                for t in (*self.stage_templates, self.adjacency.template)}
        for j, i in enumerate(live):
            stage = gate.stage[j] if cfg.ablation != "no_pruning" else cfg.fixed_stage
            out[i] = self._graft(trees[i], stage, budgets[i], rows, j)
            if out[i] is not None:
                n_ret = out[i].sources.count(RETRIEVAL)
                self.tree_nodes[RETRIEVAL] += n_ret
                self.tree_nodes["draft"] += len(out[i]) - n_ret
            if self._recorder is not None:
                # what each stage would have verified: its draft candidates
                # stop at the checkpoint's depth (the head was not stopped)
                self._recorder.add(batch[i], gate.conf[j], [
                    self._graft(_upto(trees[i], c + 1), s, budgets[i], rows, j)
                    for s, c in enumerate(cfg.checkpoints)] + [trees[i]])
            self.stage_steps[len(cfg.checkpoints) if stage is None else stage] += 1
        self._graft_time.add(time.perf_counter() - t0)
        return out

    def _graft(self, draft: DraftTree | None, stage: int | None, budget: int,
               rows: dict, j: int) -> DraftTree | None:
        """Eq. 11: the best ``K_draft`` draft nodes plus the stage's
        retrieval branch, ``budget`` nodes in all where both have enough."""
        cfg: GraftConfig = self.config
        keep = budget if stage is None else cfg.draft_budget(stage, budget)
        trie = TrieBuilder(budget)
        if draft is not None:
            trie.insert_tree(normalize_tree(draft, keep))
        # Not pruned: the base tree alone (the paper), unless the head could
        # not fill the budget; no_retrieval leaves freed slots empty.
        fill = cfg.ablation != "no_retrieval" and (stage is not None or len(trie) < budget)
        if fill:
            templates = ([self.stage_templates[stage]] if stage is not None else []) \
                + [self.adjacency.template]
            for t in templates:
                if len(trie) >= budget:
                    break
                trie.insert_tree(_log_scores(t.to_draft_tree(rows[id(t)][j],
                                                             source=RETRIEVAL)))
        return trie.build() if len(trie) else None

    def stats(self) -> ProposerStats:
        """Share of steps ending at each checkpoint, head rows per step, and
        the nodes each source put into the trees (accepted tokens per source
        are counted by the runner: ``source_accepted``)."""
        s = super().stats()
        names = [f"d{c}" for c in self.config.checkpoints] + ["unpruned"]
        s.counters.update({f"stage_{n}": v for n, v in zip(names, self.stage_steps)})
        s.counters.update({f"nodes_{k}": v for k, v in self.tree_nodes.items()})
        s.gauges["graft"] = self._graft_time.as_ms()
        s.gauges["adjacency_tenants"] = self.adjacency.num_tenants
        s.counters["tables_refused"] = self.adjacency.tables_refused
        s.gauges["thresholds"] = list(self.config.thresholds)
        return s

    @classmethod
    def rates(cls, counters: dict[str, int]) -> dict[str, float]:
        steps = sum(v for k, v in counters.items() if k.startswith("stage_"))
        out = {f"share_{k[6:]}": v / steps for k, v in counters.items()
               if k.startswith("stage_") and steps}
        return {**out, **super().rates(counters)}


def _log_scores(tree: DraftTree) -> DraftTree:
    """Template trees score nodes by acceptance probability; draft nodes by
    cumulative log-probability: one scale, so the runner's best-first cut
    compares them fairly."""
    if tree.scores is None:  # a template without priors: keep its order
        tree.scores = [-1e-3 * (i + 1) for i in range(len(tree))]
    else:
        tree.scores = [math.log(max(s, 1e-12)) for s in tree.scores]
    return tree


def _upto(tree: DraftTree | None, depth: int) -> DraftTree | None:
    if tree is None:
        return None
    return tree.select(np.flatnonzero(tree.depths() <= depth).tolist())


class _Gate:
    """The per-depth hook (Eq. 6-7): at each checkpoint, the requests whose
    best frontier path has ``c_d <= tau_d`` get that stage and, unless
    ``stop`` is False (ablation / recording), stop expanding."""

    def __init__(self, cfg: GraftConfig, n: int, stop: bool) -> None:
        # runtime depth d = candidates of depth d exist = d - 1 expansions done
        self.at = {c + 1: i for i, c in enumerate(cfg.checkpoints)}
        self.tau = cfg.thresholds
        self.stop = stop
        self.stage: list[int | None] = [None] * n
        self.conf: list[list[float | None]] = [[None] * len(cfg.checkpoints)
                                               for _ in range(n)]

    def __call__(self, depth: int, frontier_logp: torch.Tensor) -> torch.Tensor | None:
        i = self.at.get(depth)
        if i is None:
            return None
        conf = frontier_logp.max(dim=-1).values.exp().cpu().tolist()
        for b, c in enumerate(conf):
            self.conf[b][i] = c
            if self.stage[b] is None and c <= self.tau[i]:
                self.stage[b] = i
        if not self.stop:
            return None
        return torch.tensor([s is None for s in self.stage])


class _Recorder:
    """Calibration log: per drafted step, the checkpoint confidences and, for
    each stage's tree and the unpruned one, how many tokens the target went
    on to accept -- known exactly once the request has produced them, since
    greedy output does not depend on the tree that was verified."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pending: dict[str, list[tuple[int, list, list[DraftTree | None]]]] = {}
        self.tokens: dict[str, np.ndarray] = {}

    def add(self, req: StepRequest, conf: list, trees: list[DraftTree | None]) -> None:
        self.pending.setdefault(req.req_id, []).append((len(req.token_ids), conf, trees))

    def observe(self, batch: list[StepRequest]) -> None:
        for r in batch:
            self.tokens[r.req_id] = r.token_ids
            self._flush(r.req_id, final=False)

    def finish(self, req_id: str) -> None:
        self._flush(req_id, final=True)
        self.tokens.pop(req_id, None)

    def _flush(self, req_id: str, final: bool) -> None:
        items, toks = self.pending.get(req_id), self.tokens.get(req_id)
        if not items or toks is None:
            return
        keep, lines = [], []
        for n, conf, trees in items:
            depth = max((int(t.depths().max()) for t in trees if t is not None and len(t)),
                        default=0)
            if len(toks) < n + depth and not final:
                keep.append((n, conf, trees))
                continue
            truth = [int(t) for t in toks[n: n + depth]]
            acc = [0 if t is None else t.follow(truth)[1] for t in trees]
            lines.append(json.dumps({"conf": conf, "accepted": acc,
                                     "nodes": [0 if t is None else len(t) for t in trees]}))
        self.pending[req_id] = keep
        if not keep:
            self.pending.pop(req_id, None)
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")
