"""The runner's state, as named objects: what one engine step carries from
``_prepare_inputs`` through ``_sample`` to ``propose_draft_token_ids``
(``StepState``, ``RequestPlan``), and what crosses steps, per request
(``RequestBook``) and per engine (``StepClock``, ``TargetHooks``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.runner.tree_attention import LayerMoves, TreeStep


def tp_rank0_float(x: float) -> float:
    """``x`` as the first tensor-parallel rank has it (a no-op without TP):
    decisions taken from wall-clock times must be the same on every rank,
    or the ranks would verify different trees."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.broadcast(t, src=tp.ranks[0], group=tp.cpu_group)
    return float(t[0])


def root_rows(query_start_loc: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Flat row of each request's root (last verified token): vLLM's
    convention, the first of a request's last ``m+1`` scheduled rows
    (``gpu_model_runner._calc_spec_decode_metadata``), not its first row."""
    return query_start_loc[1:] - 1 - num_drafts


@dataclasses.dataclass
class StepState:
    """One engine step's tree bookkeeping: created in ``_prepare_inputs``,
    filled in ``_sample``, read in ``propose_draft_token_ids``."""

    trees: dict[int, DraftTree]
    """Batch row -> the tree verified this step (real trees, not chains)."""
    root_row: np.ndarray
    """Per batch row: flat input row of its root (see ``root_rows``)."""
    attention: TreeStep | None
    """What the attention wrapper reads during this step's forward; dropped
    once verification is done so no later forward applies it."""
    logit_base: np.ndarray | None = None
    """Per batch row: its first logits row (its root's)."""
    logit_rows: np.ndarray | None = None
    """Per batch row: how many logits rows it has (root + drafts)."""
    accepted_rows: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """Batch row -> rows (relative to the root) whose tokens were accepted:
    the root and the accepted path's nodes."""
    topk: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None
    """(ids, probs) ``[rows, k]`` of the logits rows methods read, and the
    logits row -> row-in-(ids, probs) map (-1 where not computed)."""
    entropy: tuple[torch.Tensor, np.ndarray] | None = None
    """Entropies ``[rows]`` of each request's accepted logits rows, and the
    logits row -> row-in-entropies map (-1 where not computed)."""
    drafts: list[list[int]] | None = None
    """Per batch row: its scheduled draft tokens, the scheduler's host lists
    (vLLM's device copy need not be read back)."""


@dataclasses.dataclass
class RequestBook:
    """Per request, across steps: what the runner keeps between a request's
    draft and its verification, and who drafts at all."""

    trees: dict[str, DraftTree] = dataclasses.field(default_factory=dict)
    """Request -> the tree drafted last step, verified in this one."""
    sourced: dict[str, tuple[DraftTree, int]] = dataclasses.field(default_factory=dict)
    """Request -> its tree with per-node sources and the history length when
    drafted: scored when the next step says what was accepted."""
    opted_out: set[str] = dataclasses.field(default_factory=set)
    """Requests that opted out of speculation (request_flags.SPECULATE): the
    method never sees them, they get no LM-head side work."""

    def drop(self, req_id: str) -> None:
        """Forget the request's tree (it stays opted out, if it was)."""
        self.trees.pop(req_id, None)
        self.sourced.pop(req_id, None)


@dataclasses.dataclass
class StepClock:
    """Per engine, across steps: the times and turns the budget reads."""

    step_start: float | None = None
    """``perf_counter`` at the start of the step's forward (execute_model)."""
    explore_turn: int = 0
    """Exploring steps so far: the explorer's round-robin turn."""
    side_seconds: float = 0.0
    """This step's prompt LM-head pass, drafting-only work outside the
    proposer (capture.CaptureMixin._sp_fill_topk)."""


@dataclasses.dataclass
class TargetHooks:
    """Per engine, fixed at start-up: what the plugin installed in the target
    model, read by the steps."""

    aux_index: dict[int, int] = dataclasses.field(default_factory=dict)
    """Captured residual-stream layer -> its index among the model's aux
    hidden-state outputs (returned in ascending layer order)."""
    linear_routed: list[str] = dataclasses.field(default_factory=list)
    """Weight shape ``KxN`` of each target linear layer on the small-row CPU
    linear kernel."""
    kv_layout: str = "gpu"
    """The KV cache layout the tree attention and the KV move read."""
    head_size: int | None = None
    """The target's attention head size."""
    layer_moves: LayerMoves | None = None
    """The KV move's views of the layer caches (``tree_attention.LayerMoves``),
    made at the first move, for this ``kv_layout`` and ``head_size``."""


@dataclasses.dataclass
class RequestPlan:
    """What one batch row brings to this step's drafting."""

    scheduled: int
    """Tokens vLLM scheduled for it this step."""
    computed: int
    """Tokens computed before this step: the first verified position."""
    prompt_len: int
    decoding: bool
    """A decode step (a verified draft or one token), not a prompt chunk."""
    rows: list[int]
    """The rows methods read, relative to ``first_row`` (none for a
    request that drafts nothing)."""
    first_row: int
    """Flat input row ``rows`` count from: the root's when decoding (vLLM:
    the last ``m+1`` rows), the chunk's first otherwise."""
