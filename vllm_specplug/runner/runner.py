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
from vllm.v1.sample.rejection_sampler import apply_sampling_constraints
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.structured_output.utils import strip_speculative_padding

from vllm_specplug import registry
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY
from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.engine.tree import DraftTree, normalize_tree
from vllm_specplug.engine.verify import choose_paths, draft_probs_tensor
from vllm_specplug.runner.tree_attention import (
    CPU_KV_LAYOUTS,
    TreeAttentionWrapper,
    TreeRow,
    TreeStep,
    move_accepted_kv,
    read_context_kv,
)

logger = init_logger(__name__)


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
        self._sp_step: TreeStep | None = None
        self._sp_step_trees: dict[int, DraftTree] = {}
        self._sp_rows: dict[int, list[int]] = {}
        self._sp_logit_base: np.ndarray | None = None
        self._sp_topk: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sp_proposer = None
        self._sp_stats = TreeStats()

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        model = self.get_model()
        cls = registry.get(self._sp_method)
        config = cls.config_cls(**self._sp_options)
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
        )
        self._sp_proposer = cls(config, ctx)
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

        ctx = self.compilation_config.static_forward_context
        for name, layer in ctx.items():
            if not isinstance(layer, Attention):
                continue
            impl = layer.impl
            if getattr(impl, "alibi_slopes", None) is not None or getattr(
                impl, "sliding_window", -1
            ) not in (-1, None) or getattr(impl, "logits_soft_cap", 0):
                raise ValueError(
                    f"specplug tree verification does not support layer {name} "
                    "(sliding window, ALiBi or logit soft-capping)"
                )
            if self.device.type == "cuda" and type(impl).__name__ not in (
                "FlashAttentionImpl", "TritonAttentionImpl"
            ):
                raise ValueError(
                    f"specplug tree verification on GPU supports the FLASH_ATTN and "
                    f"TRITON_ATTN backends, not {type(impl).__name__}"
                )
            if not hasattr(impl, "do_kv_cache_update"):
                raise ValueError(
                    f"specplug needs the attention backend's KV writer "
                    f"({type(impl).__name__} has no do_kv_cache_update)"
                )
            if not isinstance(impl.forward, TreeAttentionWrapper):
                impl.forward = TreeAttentionWrapper(name, impl, lambda: self._sp_step)

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        if self.device.type == "cpu":
            self._sp_check_cpu_kv_layout()

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
        for rid in gone:
            self._sp_trees.pop(rid, None)
            if prop is not None:
                prop.remove_request(rid)
        out = super()._update_states(scheduler_output)
        if prop is not None:
            for new in scheduler_output.scheduled_new_reqs:
                prop.add_request(new.req_id)
            for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
                prop.remove_request(rid)
                prop.add_request(rid)
        return out

    # ----------------------------------------------------- forward (trees)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._sp_step = None
        self._sp_step_trees = {}
        rows: list[TreeRow] = []
        qsl = self.query_start_loc.np
        for rid, toks in scheduler_output.scheduled_spec_decode_tokens.items():
            tree = self._sp_trees.get(rid)
            m = len(toks)
            if tree is None or m == 0 or tree.tokens[:m] != list(toks):
                continue  # no tree, or a stale one: vLLM verifies a chain
            tree = tree.truncated(m)
            if tree.is_chain():
                continue
            i = self.input_batch.req_id_to_index[rid]
            s = int(qsl[i])
            c = int(self.input_batch.num_computed_tokens_cpu[i])
            depths = torch.from_numpy(tree.depths() + c)
            self.positions[s + 1 : s + 1 + m] = depths.to(self.positions.device)
            mask = torch.from_numpy(tree.ancestor_mask()[1:]).to(self.device)
            rows.append(TreeRow(s, m, c, i, mask))
            self._sp_step_trees[i] = tree
        if rows:
            self._sp_step = TreeStep(rows)
        return out

    # ------------------------------------------------- verification (trees)
    def _sample(self, logits, spec_decode_metadata):
        self._sp_rows = {}
        self._sp_topk = None
        if spec_decode_metadata is not None:
            n_draft = spec_decode_metadata.num_draft_tokens
            self._sp_logit_base = np.concatenate(
                [[0], np.cumsum(np.asarray(n_draft) + 1)[:-1]]
            ).astype(np.int64)
        else:
            self._sp_logit_base = np.arange(self.input_batch.num_reqs)
        needs = self._sp_needs
        k = max(needs.topk, 8 if needs.tree_topk else 0)
        if k and logits is not None:
            probs = torch.softmax(logits.float(), dim=-1)
            vals, ids = probs.topk(k, dim=-1)
            self._sp_topk = (ids, vals)
        try:
            if spec_decode_metadata is None or not self._sp_step_trees:
                out = super()._sample(logits, spec_decode_metadata)
                if spec_decode_metadata is not None:
                    acc = (out.sampled_token_ids != -1).sum(-1).tolist()
                    for i, a in enumerate(acc):
                        self._sp_rows[i] = list(range(max(a, 1)))
                    self._sp_stats.record_chains(
                        [_num_real(d) for d in _drafts_per_request(spec_decode_metadata)],
                        acc)
                return out
            return self._sp_sample_trees(logits, spec_decode_metadata)
        finally:
            self._sp_step = None
            self._sp_step_trees = {}

    def _sp_sample_trees(self, logits, meta: SpecDecodeMetadata):
        sm = self.input_batch.sampling_metadata
        n_draft = meta.num_draft_tokens
        drafts = _drafts_per_request(meta)
        temps = self.input_batch.temperature_cpu[: len(n_draft)]
        greedy = {i for i, t in enumerate(temps) if sm.all_greedy or t == 0.0}
        probs = None
        if any(i not in greedy for i in self._sp_step_trees):
            rows_per_req = torch.tensor(
                np.cumsum(np.asarray(n_draft) + 1), device=logits.device
            )
            probs = torch.softmax(
                apply_sampling_constraints(logits.float().clone(), rows_per_req, sm),
                dim=-1,
            )
        chosen = choose_paths(
            self._sp_step_trees, drafts, self._sp_logit_base, greedy,
            logits.argmax(dim=-1).tolist(), probs, sm.generators,
        )
        path_meta, gather, path_tokens = path_chain_metadata(
            chosen.paths, drafts, self._sp_logit_base, logits.device
        )
        draft_probs = None
        if probs is not None:
            draft_probs = draft_probs_tensor(chosen.q_rows, logits.shape[-1], logits.device)
        if sm.spec_token_ids is not None:
            sm = dataclasses.replace(sm, spec_token_ids=path_tokens)
        out = self.rejection_sampler(path_meta, draft_probs, logits[gather], sm)

        accepted = ((out.sampled_token_ids != -1).sum(-1) - 1).clamp(min=0).tolist()
        self._sp_move_kv(chosen.paths, accepted)
        for i, path in enumerate(chosen.paths):
            self._sp_rows[i] = [0] + [1 + j for j in path[: accepted[i]]]
        self._sp_stats.record_trees([_num_real(d) for d in drafts], accepted,
                                    self._sp_step_trees)
        return out

    def _sp_move_kv(self, paths, accepted) -> None:
        step = self._sp_step
        if step is None or not step.capture:
            return
        moves, offset = [], 0
        slots = step.slot_mapping
        for r in step.rows:
            path = paths[r.req_index][: accepted[r.req_index]]
            for k, j in enumerate(path):
                if j != k:  # node j sits in the slot of depth j+1, not k+1
                    moves.append((offset + 1 + j, int(slots[r.row_start + 1 + k])))
            offset += r.num_nodes + 1
        self._sp_stats.kv_moves += len(moves)
        move_accepted_kv(step, moves)

    # ---------------------------------------------------------- drafting
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        t0 = time.perf_counter()
        needs = self._sp_needs
        qsl = self.query_start_loc.np
        budget = self.speculative_config.num_speculative_tokens
        if scheduler_output.num_spec_tokens_to_schedule:
            budget = min(budget, scheduler_output.num_spec_tokens_to_schedule)
        batch: list[StepRequest] = []
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        for i, rid in enumerate(self.input_batch.req_ids):
            n_sched = scheduler_output.num_scheduled_tokens[rid]
            c = int(self.input_batch.num_computed_tokens_cpu[i])
            ntok = int(self.input_batch.num_tokens_no_spec[i])
            n_prompt = int(self.input_batch.num_prompt_tokens[i])
            is_decode = rid in scheduled or (n_sched == 1 and c >= n_prompt)
            rel = self._sp_rows.get(i, [0]) if is_decode else list(range(n_sched))
            rows = torch.as_tensor(qsl[i] + np.asarray(rel), device=hidden_states.device)
            req = self.requests.get(rid)
            sp = req.sampling_params if req is not None else None
            sreq = StepRequest(
                req_id=rid,
                token_ids=self.input_batch.token_ids_cpu[i, :ntok],
                num_prompt_tokens=n_prompt,
                sampled=len(sampled_token_ids[i]) > 0,
                verified_pos=c,
                temperature=float(sp.temperature) if sp is not None else 0.0,
                chain_only=_chain_only(sp),
                draft_kept=_num_real(scheduled.get(rid, ())),
            )
            if needs.hidden:
                sreq.hidden = hidden_states[rows]
            if needs.hidden_layer is not None and aux_hidden_states:
                idx = self._sp_aux_index[needs.hidden_layer + 1]
                sreq.layer_hidden = aux_hidden_states[idx][rows]
            if needs.aux_layers and aux_hidden_states:
                sreq.aux_hidden = torch.cat(
                    [aux_hidden_states[self._sp_aux_index[x]][rows] for x in needs.aux_layers],
                    dim=-1)
            self._sp_fill_topk(sreq, i, rel, is_decode, hidden_states, rows, qsl,
                               n_sched)
            batch.append(sreq)
        t1 = time.perf_counter()
        trees = self._sp_proposer.propose(batch)
        t2 = time.perf_counter()
        drafts: list[list[int]] = []
        for sreq, tree in zip(batch, trees):
            room = min(budget, self.max_model_len - len(sreq.token_ids) - 1)
            if tree is None or room <= 0 or not sreq.sampled:
                self._sp_trees.pop(sreq.req_id, None)
                drafts.append([])
                continue
            tree = normalize_tree(tree, room)
            if sreq.chain_only and not tree.is_chain():
                tree = tree.first_path()
            self._sp_trees[sreq.req_id] = tree
            drafts.append(tree.tokens)
        self._sp_stats.record_propose(t1 - t0, t2 - t1)
        return drafts

    def _sp_fill_topk(self, sreq, i, rel, is_decode, hidden_states, rows, qsl,
                      n_sched) -> None:
        needs = self._sp_needs
        if self._sp_topk is None:
            return
        ids, vals = self._sp_topk
        base = int(self._sp_logit_base[i])
        if is_decode:
            lrows = torch.as_tensor([base + r for r in rel], device=ids.device)
            sreq.topk_ids, sreq.topk_probs = ids[lrows], vals[lrows]
            if needs.tree_topk:
                # Every verified row of the tree, accepted or not.
                sreq.node_tokens = self.input_ids.gpu[qsl[i] : qsl[i] + n_sched].clone()
                sreq.node_topk_ids = ids[base : base + n_sched]
        elif needs.prefill_topk and n_sched > 0:
            lg = self.model.compute_logits(hidden_states[rows])
            v, t = torch.softmax(lg.float(), -1).topk(ids.shape[-1], dim=-1)
            sreq.topk_ids, sreq.topk_probs = t, v
            sreq.node_tokens = self.input_ids.gpu[qsl[i] : qsl[i] + n_sched].clone()
            sreq.node_topk_ids = t
        elif sreq.sampled:
            # Only the prompt's last position has logits without prefill_topk.
            row = torch.as_tensor([base], device=ids.device)
            sreq.topk_ids, sreq.topk_probs = ids[row], vals[row]

    # --------------------------------------------------------------- stats
    def specplug_stats(self) -> dict[str, Any]:
        stats = self._sp_stats.as_dict()
        if hasattr(self._sp_proposer, "stats"):
            stats["method"] = self._sp_proposer.stats()
        return stats
