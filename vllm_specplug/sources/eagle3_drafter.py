"""The EAGLE-3 tree drafter: a source that methods compose.

An EAGLE-3 head reads the target's low/middle/high-layer features of every
verified row (``Needs.aux_layers``, prefill chunks included) into its own
per-request K/V state, then expands a tree from the last verified token:
the top-k frontier depth by depth, one head pass per depth for the whole
batch, the best ``num_speculative_tokens`` nodes by cumulative
log-probability, best path first. The head's runtime lives in
:mod:`vllm_specplug.eagle3.runtime`; this file holds the drafter's options,
the rows it holds for gated requests, and its glue to the runtime.
``eagle3_tree`` uses it as is; ``graft``, ``reader`` and ``respec`` extend
it (its per-depth hook and the per-node scores of its trees).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from vllm_specplug.config import MethodConfig, SpecplugConfigError, missing_option, option_error
from vllm_specplug.engine.interface import (
    Needs,
    Proposer,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.stats import RunningStat
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.template import TreeTemplate, parse_level_counts

if TYPE_CHECKING:
    import torch

    from vllm_specplug.eagle3.runtime import DepthHook

logger = logging.getLogger(__name__)

HELD_BYTES = 16 << 20
"""Memory a gated request's held rows may take by default (``max_held_rows``)."""

MIB = 1 << 20


def default_held_rows(n_aux: int, hidden_size: int) -> int:
    """``max_held_rows`` when None: the float32 rows of ``n_aux`` target
    features that ``HELD_BYTES`` hold, at least 1024."""
    return max(1024, HELD_BYTES // (n_aux * hidden_size * 4))


def head_gemm_dtype(choice: str) -> torch.dtype:
    """The weight dtype of ``Eagle3DrafterConfig.head_gemm_dtype`` on this CPU."""
    import torch

    if choice == "auto":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        choice = "bfloat16" if native else "float32"
    return getattr(torch, choice)


class Eagle3DrafterConfig(MethodConfig):
    """Options of the EAGLE-3 tree drafter (every method composing it has them)."""

    head: str | None = None
    """EAGLE-3 head folder (``config.json`` + ``model.safetensors``, as
    ``specplug eagle3 train`` writes it). None: the head shipped for this
    target's shape (the reference model has one); any other target must
    name one."""
    depth: int = Field(default=8, ge=1, le=32)
    """Deepest draft level (EAGLE-2/3 and the Graft paper: 8)."""
    topk: int = Field(default=10, ge=1, le=64)
    """Children per expanded node and frontier width per depth (papers: 10).
    ``topk=1`` drafts the head's greedy chain."""
    mode: Literal["dynamic", "static"] = "dynamic"
    """``dynamic``: EAGLE-2's top-k frontier by cumulative log-probability.
    ``static``: expand the rank template ``template`` (fixed shape, for
    READER's shape optimisation); nodes are still kept by score."""
    template: str = "default"
    """Static mode's shape: a preset of ``sources/template.py`` or nodes per
    level, e.g. ``"8,6,4,3,2"``; ranks below ``topk``."""
    screen_lm_head: bool = True
    """On a CPU, rank each drafting level's tokens with an int8 copy of the
    head's LM head and recompute only each row's best 32 in float32
    (``eagle3/screen.py``): a quarter of the LM head's weight bytes per
    level, trees nearly the float32 head's. Drafts only: the output is the
    same either way. False: the float32 LM head (EAGLE-2's trees exactly)."""
    head_gemm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """On a CPU, the dtype of the weights the head's linear layers draft
    with (inputs cast to it, outputs back to float32). A drafting level
    streams every weight of the head's layer for a handful of rows, so its
    time is the weights' bytes: bfloat16 halves them. ``auto``: bfloat16
    where the CPU has bfloat16 arithmetic (AVX512-BF16 or AMX), float32
    elsewhere (converting each weight on the fly would cost more than it
    saves). Drafts only: the output is the same either way."""
    max_held_rows: int | None = Field(default=None, ge=0)
    """Verified rows a request asked for no draft (the cost-aware gate
    closed) holds before feeding them to the head anyway, in one batched
    pass: bounds the memory a long gated request holds (``3 * hidden``
    floats a row: 6.75 KiB for the reference model, 48 KiB for a 4096-wide
    target) and the catch-up its next draft pays. 0 feeds every step.
    None: as many rows as ``HELD_BYTES`` (16 MiB) hold, at least 1024
    (2427 for the reference model: enough to hold a ~1200-token
    summarization prompt while the gate is closed, which a bound of 1024
    would feed whole)."""
    max_total_held_mib: int | None = Field(default=512, ge=0)
    """Memory the held rows of all requests together may take (MiB; each
    request's own bound is ``max_held_rows``). Past it, a gated request's
    rows are fed to the head at once instead of held: a head pass more,
    never a different token (counted as ``held_fed_at_cap``). Held rows
    live on the engine's device. None: no bound across requests."""
    max_request_kv_tokens: int | None = Field(default=None, ge=1)
    """Head K/V positions one request may hold (``2 * kv_heads *
    head_dim`` values a position: 1.5 KiB for the reference model's float32
    head, 4 KiB for an 8-KV-head, 128-dim bfloat16 head). A request whose
    context passes it stops drafting with the head until it ends (its K/V
    freed; verified as plain decoding, counted as ``kv_capped``). None: no
    bound of its own (a state holds the request's context, allocated by
    doubling: under ``2 * max_model_len`` positions)."""
    max_total_kv_mib: int | None = Field(default=2048, ge=0)
    """Memory the head K/V of all running requests together may take
    (MiB, on the engine's device; the prefix store is apart, see
    ``prefix_store_tokens``). A request whose K/V would not fit stops
    drafting with the head until it ends, as with
    ``max_request_kv_tokens``. 2048 MiB hold 1.4 M positions of the
    reference model's head, 512 k of a 4 KiB-per-position head. None: no
    bound."""
    prefix_store_tokens: int = Field(default=1 << 16, ge=0)
    """Head K/V positions kept (LRU, by token prefix) for prompt blocks vLLM
    serves from its prefix cache; a request whose cached prefix is not in the
    store drafts nothing (counted as ``store_misses``; a prefix that ends
    where the requests part is served from a block stored before another
    token, ``store_near_hits``). A block is served
    only to requests of the tenant that stored it (``isolation``); requests
    without a tenant (isolation ``strict``) neither store nor fill. Memory,
    on the engine's device: this many positions of head K/V (see
    ``max_request_kv_tokens``): 96 MiB for the reference model's head at
    the default, 256 MiB for a 4 KiB-per-position head."""

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        parse_level_counts(value)
        return value

    def check_against(self, num_speculative_tokens: int) -> None:
        if self.head is not None and not os.path.isfile(
                os.path.join(self.head, "model.safetensors")):
            raise option_error("head", f"no EAGLE-3 head (model.safetensors) in "
                                       f"{self.head!r}")
        try:  # a template file's ranks must lie below topk
            self.build_template()
        except ValueError as e:
            raise option_error("template", str(e)) from None

    def build_template(self) -> TreeTemplate | None:
        """Static mode's template (ranks below ``topk``, at most 16); None
        in dynamic mode."""
        if self.mode != "static":
            return None
        return TreeTemplate.from_spec(self.template, min(self.topk, 16))


class Eagle3Drafter(Proposer):
    """The drafter's state and steps; methods subclass it and set ``name``
    and ``config_cls``."""

    tenant_aware = True  # the head's prefix store serves a request only its tenant's blocks
    config_cls = Eagle3DrafterConfig

    def __init__(self, config: Eagle3DrafterConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        from vllm_specplug.eagle3 import default_head_for
        from vllm_specplug.eagle3.model import load_head
        from vllm_specplug.eagle3.runtime import Eagle3Runtime

        head_dir = config.head or default_head_for(ctx.model_path)
        if head_dir is None:
            raise missing_option("head", "eagle3_tree",
                                 f"specplug ships no EAGLE-3 head for {ctx.model_path}")
        if ctx.embed_tokens is None:
            raise SpecplugConfigError("method 'eagle3_tree' needs the target's input "
                                      "embeddings, which this model does not expose")
        head = load_head(head_dir, ctx.embed_tokens.float().cpu())
        hc = head.cfg
        if hc["vocab_size"] != ctx.vocab_size or hc.get(
                "target_hidden_size", hc["hidden_size"]) != ctx.hidden_size:
            raise option_error(
                "head", f"{head_dir} was built for a target with vocab "
                f"{hc['vocab_size']} / hidden {hc.get('target_hidden_size')}, this one "
                f"has {ctx.vocab_size} / {ctx.hidden_size}")
        self.head_dir = head_dir
        self.aux_layers = tuple(hc["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        head = head.to(ctx.device)
        self.runtime = Eagle3Runtime(
            head, config.prefix_store_tokens,
            max_request_tokens=config.max_request_kv_tokens,
            max_kv_bytes=None if config.max_total_kv_mib is None
            else config.max_total_kv_mib * MIB,
            screen_lm_head=config.screen_lm_head and ctx.device.type == "cpu")
        if ctx.prepare_linears is not None:  # the engine's GEMM kernels: 3-4x on CPU
            # the layers drafting runs: the fused decoder layer's, not the
            # checkpoint's separate q/k/v/gate/up (packed copies of those would
            # cost their size again and never run); a screened LM head is
            # read by rows only, so it is not packed either
            parts = [head.fc, self.runtime.layer]
            if self.runtime.screen is None:
                parts.append(head.lm_head)
            gemm_dtype = head_gemm_dtype(config.head_gemm_dtype)
            for part in parts:
                ctx.prepare_linears(part, weight_dtype=gemm_dtype)
        self.runtime.warm_up(config.depth, config.topk)
        self.template = config.build_template()
        self._extend_time, self._draft_time = RunningStat(), RunningStat()
        self._steps = 0
        # Verified rows a request has not fed the head yet, as (first
        # position, [aux chunks], rows): see extend().
        self._deferred: dict[str, tuple[int, list[torch.Tensor], int]] = {}
        self.max_held_rows = (config.max_held_rows if config.max_held_rows is not None
                              else default_held_rows(len(self.aux_layers), ctx.hidden_size))
        self.max_held_bytes = (None if config.max_total_held_mib is None
                               else config.max_total_held_mib * MIB)
        self.held_bytes = 0
        """What every request's held rows take now."""
        self.held_fed_at_cap = 0
        self._held_cap_logged = False

    def needs(self) -> Needs:
        return Needs(aux_layers=self.aux_layers)

    def add_request(self, req_id: str) -> None:
        self.runtime.add(req_id)

    def remove_request(self, req_id: str) -> None:
        self.runtime.remove(req_id)
        self._release(req_id)

    def _release(self, req_id: str) -> tuple[int, list[torch.Tensor], int] | None:
        """Take the request's held rows out of the bookkeeping."""
        held = self._deferred.pop(req_id, None)
        if held is not None:
            self.held_bytes -= _nbytes(held[1], held[2])
        return held

    def _may_hold(self, chunks: list[torch.Tensor], n_rows: int) -> bool:
        """Rows may be held within both bounds (one request's, all
        requests'); past the second the cap is counted and logged once."""
        if n_rows > self.max_held_rows:
            return False
        if (self.max_held_bytes is None
                or self.held_bytes + _nbytes(chunks, n_rows) <= self.max_held_bytes):
            return True
        self.held_fed_at_cap += 1
        if not self._held_cap_logged:
            self._held_cap_logged = True
            logger.warning("specplug: held rows of all requests reached max_total_held_mib="
                           "%d; gated requests' rows are fed to the head at once "
                           "(counted as held_fed_at_cap; logged once)",
                           self.config.max_total_held_mib)
        return False

    def propose(self, batch: list[StepRequest],
                drafting: list[bool] | None = None) -> list[DraftTree | None]:
        """``drafting`` (for methods that compose this one): per request,
        False = only extend the head's state, draft nothing."""
        self.extend(batch)
        return self.draft(batch, [r.budget if drafting is None or drafting[i] else 0
                                  for i, r in enumerate(batch)])

    def extend(self, batch: list[StepRequest]) -> None:
        """Every verified row feeds the head's state, whoever drafted (methods
        that compose this drafter call it every step, drafting or not)."""
        import torch

        t0 = time.perf_counter()
        items = []
        for r in batch:
            self.runtime.bind(r.req_id, r.tenant)
            if r.aux_hidden is None:
                continue
            pos, chunks, n_rows = r.verified_pos, [r.aux_hidden], int(r.aux_hidden.shape[0])
            first, held, n_held = self._release(r.req_id) or (pos, [], 0)
            if pos == first + n_held:
                # the usual case: this step's rows follow the held ones
                pos, chunks, n_rows = first, held + chunks, n_held + n_rows
            elif first <= pos < first + n_held:
                # the target recomputed some held rows (they come again in
                # this step's): keep only the held rows before them
                keep, out = pos - first, []
                for c in held:
                    take = min(keep, int(c.shape[0]))
                    if take:
                        out.append(c[:take])
                    keep -= take
                pos, chunks, n_rows = first, out + chunks, (pos - first) + n_rows
            # (a gap: the held rows are dropped; the runtime fills gaps from
            # its prefix store or stops drafting for the request)
            no_draft = r.budget <= 0 if r.sampled else not r.drafting
            if no_draft and self._may_hold(chunks, n_rows):
                # No draft asked this step (the cost-aware gate, or the
                # context's end), or a prompt chunk while the gate is closed:
                # hold the rows and feed them, in one batched pass, when a
                # draft is asked. A gated request costs no head pass at all
                # (until it holds more than max_held_rows: a long prompt is
                # fed), and holding is O(1) a step (a gated step must cost
                # nothing): feeding every prompt at once would spend a head
                # pass over a batch of long prompts whose drafts may never
                # be asked for.
                # This step's rows are a view of the whole step's gathered
                # rows (runner/capture.py, _sp_gather): held as a copy, or
                # the view would keep every request's rows of the step alive.
                chunks[-1] = chunks[-1].clone()
                self._deferred[r.req_id] = (pos, chunks, n_rows)
                self.held_bytes += _nbytes(chunks, n_rows)
                continue
            aux = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            items.append((r.req_id, pos, r.token_ids, aux))
        if items:  # a step every request held in (the gate closed) runs no head code
            self.runtime.extend(items)
        self._extend_time.add(time.perf_counter() - t0)

    def catch_up_rows(self, req_id: str, new_rows: int) -> int:
        """The rows the head holds for the request plus this step's: what it
        processes before the request's next draft."""
        return self._deferred.get(req_id, (0, [], 0))[2] + new_rows

    def draft(self, batch: list[StepRequest], budgets: list[int],
              hook: DepthHook | None = None) -> list[DraftTree | None]:
        """Trees of at most ``budgets[i]`` nodes (0: none) for the requests
        whose head state is ready; ``hook`` as in ``Eagle3Runtime.draft``."""
        t1 = time.perf_counter()
        ids = [r.req_id for r in batch]
        budgets = [b if r.sampled and self.runtime.ready(r.req_id, len(r.token_ids)) else 0
                   for r, b in zip(batch, budgets)]
        cfg: Eagle3DrafterConfig = self.config
        trees = self.runtime.draft(ids, budgets, depth=cfg.depth, topk=cfg.topk,
                                   template=self.template, hook=hook,
                                   token_seconds=[r.token_seconds for r in batch])
        if any(b > 0 for b in budgets):
            self._draft_time.add(time.perf_counter() - t1)
            self._steps += 1
        return trees

    def stats(self) -> ProposerStats:
        """Proposer cost per step (state extension + tree drafting) and the
        head rows it ran."""
        s = self.runtime.stats
        return ProposerStats(
            counters={"extended_rows": s.extended_rows, "draft_head_rows": s.head_rows,
                      "draft_head_passes": s.head_passes,
                      "draft_steps": self._steps, "stopped_cost": s.stopped_cost,
                      "store_hits": s.store_hits, "store_near_hits": s.store_near_hits,
                      "store_misses": s.store_misses, "kv_capped": s.kv_capped,
                      "held_fed_at_cap": self.held_fed_at_cap},
            gauges={"head": os.path.basename(os.path.normpath(self.head_dir)),
                    "extend": self._extend_time.as_ms(), "draft": self._draft_time.as_ms(),
                    "live_requests": len(self.runtime.states),
                    "head_kv_bytes": self.runtime.kv_bytes,
                    "prefix_store_bytes": self.runtime.store_bytes,
                    "held_bytes": self.held_bytes})

    @classmethod
    def rates(cls, counters: dict[str, int]) -> dict[str, float]:
        """Head rows and batched head passes per drafting step (a GPU step's
        drafting latency follows the passes, a CPU's the rows)."""
        steps = counters.get("draft_steps", 0)
        if not steps:
            return {}
        return {"head_rows_per_step": counters.get("draft_head_rows", 0) / steps,
                "head_passes_per_step": counters.get("draft_head_passes", 0) / steps}


def _nbytes(chunks: list[torch.Tensor], n_rows: int) -> int:
    """What ``n_rows`` held rows take (``chunks``: rows of one width and
    dtype). From the row count, not a walk over the chunks: a gated request
    gains a chunk a step, and summing them every step made a long gated
    request's step cost grow with its length."""
    last = chunks[-1]
    return n_rows * last.shape[-1] * last.element_size()
