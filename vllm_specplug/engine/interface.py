"""What a method sees every step, and what it gives back.

This is the contract between the runner layer (the only code that touches
vLLM internals, ``vllm_specplug/runner/``) and the methods. Everything here
is plain numpy/torch, keyed by vLLM's request id, so a method never depends on
how vLLM orders batch rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.engine.verify import RelaxedRule

if TYPE_CHECKING:
    from vllm_specplug.config import MethodConfig


@dataclass(frozen=True)
class Needs:
    """What a method asks the runner to capture from the target forward pass.

    Capturing costs time, so each method declares only what it uses.
    """

    hidden: bool = False
    """Last-layer hidden states (input of the LM head) at verified positions."""
    hidden_layer: int | None = None
    """Also capture the output of this decoder layer (0-based) at verified
    positions (PLD+/AdaPLD rerank with an intermediate layer)."""
    topk: int = 0
    """Top-k next-token ids/probabilities (raw logits, before sampling
    processing) at verified decode positions."""
    prefill_topk: bool = False
    """Also compute top-k at the last ``prefill_topk_rows`` positions of
    every prompt chunk (costs an LM-head pass over them; the adjacency table
    learns from it). Skipped while the cost-aware budget's gate is closed
    (drafting does not pay then, so neither does learning for it): the
    chunk then has only its last row's top-k, as without this flag."""
    prefill_topk_rows: int = 64
    """With ``prefill_topk``: most prompt rows per chunk that get a top-k.
    Bounded because the pass is paid before the budget can judge the new
    prompts: over whole prompts (~0.2 ms a row on a 2-core CPU) it can cost
    a batch of long prompts a sixth of its time when the gate was left open
    by earlier requests, and the prompt's last rows are the ones nearest
    what is generated next."""
    tree_topk: bool = False
    """Top-k at every verified tree node, accepted or rejected."""
    topk_probs: bool = True
    """With ``topk``: also the top-k probabilities (``StepRequest.topk_probs``).
    Methods that read only the ids set False: the probabilities cost a
    normaliser over the whole vocabulary per row, about as much as the top-k
    itself (every row of every tree with ``tree_topk``)."""
    aux_layers: tuple[int, ...] = ()
    """Residual-stream layers to capture at every verified row, prefill
    chunks included (vLLM's aux convention: layer ``L`` is the input of
    decoder layer ``L``, i.e. after ``L`` layers). Concatenated in this order
    into ``StepRequest.aux_hidden`` (EAGLE-3 heads read three)."""
    entropy: bool = False
    """The target's next-token entropy (nats, of the raw logits) at every
    verified decode row and at the last ``prompt_entropy_rows`` rows of each
    prompt chunk, in ``StepRequest.entropy`` (ReSpec's trigger reads it).
    Costs a softmax over the vocabulary per row, plus an LM-head pass over
    those prompt rows."""
    prompt_entropy_rows: int = 4
    """With ``entropy``: prompt rows per chunk that get an entropy (the
    trigger looks a few tokens back; a whole prompt would cost an LM-head
    pass over all of it)."""
    relaxed: RelaxedRule | None = None
    """LOSSY opt-in (ReSpec's relaxed verification): greedy requests accept
    some rejected nodes of the named sources (``engine/verify.py``)."""
    rows_on_host: bool = False
    """The method reads ``hidden``, ``layer_hidden``, ``topk_ids``,
    ``topk_probs`` and ``entropy`` on the host: the runner brings every
    request's rows back in one device->host copy a step instead of one (or
    several) per request. ``aux_hidden`` and the tree rows' top-k stay on
    the device."""


@dataclass
class StepRequest:
    """One request after a target step.

    Rows of ``hidden``/``topk_*`` cover positions ``verified_pos ..
    verified_pos + n_rows - 1``: the prompt chunk at prefill, or the root plus
    the accepted path at a decode step. Row ``r`` is the target's output after
    reading ``token_ids[verified_pos + r]``. Tensors are views valid only
    during ``propose``: copy what you keep.
    """

    req_id: str
    token_ids: np.ndarray
    """Verified history: prompt + output, ending with the token just sampled."""
    num_prompt_tokens: int
    sampled: bool
    """False for a prompt chunk that did not finish the prompt: no draft."""
    verified_pos: int
    hidden: torch.Tensor | None = None
    """``hidden``, ``layer_hidden``, ``aux_hidden``: slices of the step's
    rows gathered for the whole batch at once; a method that keeps them past
    the step keeps a copy (a slice keeps the whole batch's rows alive)."""
    layer_hidden: torch.Tensor | None = None
    aux_hidden: torch.Tensor | None = None
    """``[n_rows, len(aux_layers) * hidden]``: the layers of
    ``Needs.aux_layers`` at the same rows as ``hidden``, concatenated."""
    topk_ids: torch.Tensor | None = None
    """``[n, k]`` the target's top-k next tokens: row ``r`` follows
    ``token_ids[verified_pos + topk_offset + r]`` (every verified row at a
    decode step; a prompt chunk's last ``Needs.prefill_topk_rows`` rows, or
    only its last row)."""
    topk_probs: torch.Tensor | None = None
    topk_offset: int = 0
    """Where ``topk_ids``' rows start, relative to ``verified_pos``: 0 at a
    decode step; a prompt chunk's rows are its last ones."""
    entropy: torch.Tensor | None = None
    """``[m]`` float32 (``Needs.entropy``): the target's entropy at the
    *last* ``m`` of this step's rows, i.e. of the distributions after reading
    ``token_ids[verified_pos + n_rows - m .. verified_pos + n_rows - 1]``
    (all rows at a decode step, the last ``prompt_entropy_rows`` of a prompt
    chunk)."""
    node_tokens: torch.Tensor | None = None
    """Input token of every verified tree row (root first), accepted or not."""
    node_topk_ids: torch.Tensor | None = None
    """``[len(node_tokens), k]`` target top-k after each of those rows."""
    temperature: float = 0.0
    """0 for greedy requests."""
    chain_only: bool = False
    """The request's sampling needs vLLM's chain verifier (penalties, bad
    words, logits processors, structured output): return a chain or nothing."""
    draft_kept: int = 0
    """Nodes of this request's previous tree that this step verified: its
    first ``draft_kept`` nodes (the runner's budget and vLLM's scheduler
    may keep only a prefix; 0 when nothing was verified)."""
    token_seconds: float = 0.0
    """What one accepted token saves this step: the target's measured
    plain-step time per decoding request at this step's batch (the
    cost-aware budget's step-cost curve); 0 when unknown (budget off, or no
    step measured yet) and in a step the gate keeps from drafting. A drafter
    whose cost grows with its depth (a head's passes) stops deepening where
    a level is worth less than it costs."""
    drafting: bool = True
    """The cost-aware budget's gate lets this request draft this step
    (False: drafting does not pay now). A prompt chunk never drafts, but a
    method may hold work that only serves drafts (a head's pass over the
    prompt) while this is False (``eagle3_tree``)."""
    budget: int = 0
    """Most draft nodes the next step can verify for this request, computed
    once by the runner (``draft_budget``): ``num_speculative_tokens``, cut
    by what the scheduler will schedule and by what ``max_model_len``
    leaves; 0 when nothing was sampled. Draft nothing when it is 0; a
    bigger tree is cut to its first ``budget`` nodes."""
    tenant: str | None = None
    """Whose cross-request state this request may read and write
    (:mod:`vllm_specplug.tenancy`): ``"public"`` (requests without a
    ``cache_salt``), ``"t:<keyed hash of the salt>"``, or None: share
    nothing (isolation ``strict``, or a request the engine core did not tag).
    A method that keeps state across requests keys it by this."""

    @property
    def last_token(self) -> int:
        return int(self.token_ids[-1])


def draft_budget(num_speculative_tokens: int, num_spec_to_schedule: int,
                 max_model_len: int, num_tokens: int, sampled: bool) -> int:
    """``StepRequest.budget``: draft nodes one step can verify.

    ``num_spec_to_schedule`` is vLLM's per-step cap (0: none). Verifying
    ``n`` nodes appends up to ``n + 1`` tokens (the accepted path plus the
    bonus token), so ``n <= max_model_len - num_tokens - 1``.
    """
    if not sampled:
        return 0
    budget = num_speculative_tokens
    if num_spec_to_schedule:
        budget = min(budget, num_spec_to_schedule)
    return max(0, min(budget, max_model_len - num_tokens - 1))


@dataclass
class ProposerContext:
    """Static facts about the engine a method may size itself by."""

    vocab_size: int
    hidden_size: int
    num_speculative_tokens: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    model_path: str
    tokenizer_path: str
    embed_tokens: torch.Tensor | None = None
    """The target's input embedding matrix ``[vocab, hidden]`` (read-only)."""
    num_hidden_layers: int = 0
    prepare_linears: Callable[..., int] | None = None
    """``(module, weight_dtype=None)``: moves a drafter module's
    ``nn.Linear`` layers onto the engine's own GEMM kernels (vLLM's
    prepacked CPU kernels; ``runner/cpu_gemm.py``), with weights in
    ``weight_dtype`` when given, and returns how many; None where the
    engine has none better than torch's."""


@dataclass
class ProposerStats:
    """What a method reports, split by how a reader combines two snapshots
    (the benchmark's per-suite deltas, a metrics exporter)."""

    counters: dict[str, int] = field(default_factory=dict)
    """Running totals since start-up: a reader subtracts two snapshots."""
    gauges: dict[str, Any] = field(default_factory=dict)
    """Levels as of now (sizes, latency summaries): read as they are."""


class DraftDeadline:
    """The per-step time budget of a method's request-by-request lookup work
    (``MethodConfig.max_draft_ms``).

    A method that drafts request by request asks :meth:`order` for the
    order to visit the step's requests (which also starts the clock), then
    :meth:`allows` before each request's lookup. Once the budget is spent
    the remaining requests are refused and counted (``skipped``); they
    decode plainly this step, so output is unchanged. The refused requests
    come first in the next step's order, so the same ones are not starved
    step after step. A method's own state upkeep (syncing an index,
    learning from the verified tokens) is not gated: only drafting is."""

    def __init__(self, max_ms: float = 0.0, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.max_seconds = max(0.0, float(max_ms)) / 1000.0
        """0: no limit."""
        self.clock = clock
        self.skipped = 0
        """Request drafts refused since start-up."""
        self._start = 0.0
        self._starved: set[str] = set()
        self._refused: set[str] = set()

    def order(self, batch: Sequence[StepRequest]) -> list[int]:
        """Start this step's clock; the indices of ``batch`` in the order to
        draft them: the requests refused last step first, then the others,
        each group in batch order."""
        self._start = self.clock()
        self._starved, self._refused = self._refused, set()
        first = [i for i, r in enumerate(batch) if r.req_id in self._starved]
        return first + [i for i, r in enumerate(batch) if r.req_id not in self._starved]

    def allows(self, req_id: str) -> bool:
        """Whether ``req_id`` may still draft this step; a refusal is
        counted and remembered for the next step's order."""
        if not self.max_seconds or self.clock() - self._start < self.max_seconds:
            return True
        self.skipped += 1
        self._refused.add(req_id)
        return False


class Proposer:
    """Base class of every specplug method.

    Subclasses set ``name`` (the ``speculative_config['method']`` value) and
    ``config_cls``, implement ``propose`` and override only the hooks
    declared here. ``vllm_specplug.registry`` lists the built-in methods by
    import path; a third-party method is added with
    ``registry.register(name, "package.module:Class")``.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[MethodConfig]]
    #: True when the method drafts from earlier requests' outputs (a global
    #: suffix tree, a shared adjacency table): the same prompts asked again
    #: are drafted from its memory of their answers, so a benchmark that
    #: times a suite twice in one engine (``benchmarks.run --repeats``)
    #: counts only the first time.
    remembers_outputs: ClassVar[bool] = False
    #: True when the method keys every state it keeps across requests by
    #: ``StepRequest.tenant`` and keeps none for tenant None. A method that
    #: ``remembers_outputs`` without it is refused at start-up unless the
    #: engine's ``isolation`` is ``off`` (it would let users draft from each
    #: other's outputs).
    tenant_aware: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, ctx: ProposerContext) -> None:
        self.config = config
        self.ctx = ctx
        self.deadline = DraftDeadline(getattr(config, "max_draft_ms", 0.0))
        """The step's drafting time budget, for methods that draft request by
        request (``DraftDeadline``)."""

    def needs(self) -> Needs:
        return Needs()

    def add_request(self, req_id: str) -> None:
        """A request arrived (or came back after preemption)."""

    def remove_request(self, req_id: str) -> None:
        """A request finished, was aborted or preempted: free its state."""

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        """One draft tree (or None) per request, at most ``req.budget``
        nodes each (the runner cuts a bigger one)."""
        raise NotImplementedError

    def catch_up_rows(self, req_id: str, new_rows: int) -> int:
        """Rows of held work (e.g. a head's rows held while the cost-aware
        gate was closed) the method would process before it can draft for
        ``req_id`` this step, this step's ``new_rows`` included; 0 (the
        default) when a draft costs the same for every request. The runner
        picks a closed gate's exploring request by it
        (``engine/budget.pick_explorer``)."""
        return 0

    def stats(self) -> ProposerStats:
        """The method's own counters and gauges (none by default)."""
        return ProposerStats()

    @classmethod
    def rates(cls, counters: dict[str, int]) -> dict[str, float]:
        """Ratios derived from ``stats().counters``; readers recompute them
        from counter differences (e.g. over one benchmark suite), since the
        difference of two ratios means nothing."""
        return {}

    def report(self, s: ProposerStats | None = None) -> dict[str, Any]:
        """``stats()`` (or ``s``) flattened with its rates: what
        ``specplug_stats()['method']`` shows (not meant to be overridden)."""
        s = self.stats() if s is None else s
        return {**s.counters, **s.gauges, **self.rates(s.counters)}
