"""Start-up: the method, its budget, hidden-state capture, the tree
attention wrapper, and the plugin's share of vLLM's memory profiling."""

from __future__ import annotations

import torch

from vllm.logger import init_logger

from vllm_specplug import registry
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY, GRAPH_KEY
from vllm_specplug.engine.budget import BudgetController, FixedBudget, make_budget
from vllm_specplug.engine.interface import ProposerContext
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.kernels.cache_layout import CPU_KV_LAYOUTS
from vllm_specplug.runner import reserve
from vllm_specplug.runner.checks import (
    check_engine_config,
    check_graph_mode,
    check_kv_groups,
    check_layers,
)
from vllm_specplug.runner.cpu_fixes import apply_vllm_cpu_fixes
from vllm_specplug.runner.cpu_gemm import cpu_linear_routing, prepare_cpu_linears
from vllm_specplug.runner.step_state import RequestBook, StepClock, StepState, TargetHooks
from vllm_specplug.runner.tree_attention import (
    TreeAttentionWrapper,
    TreeStep,
    read_context_kv,
)
from vllm_specplug.tenancy import ISOLATION_SHARES

logger = init_logger("vllm.specplug.runner")


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


class SetupMixin:
    """The runner's start-up (see module doc)."""

    def _sp_init(self) -> None:
        spec = self.vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]
        self._sp_method: str = spec["method"]
        self._sp_options: dict = spec["options"]
        self._sp_requests = RequestBook()
        self._sp_clock = StepClock()
        self._sp_target = TargetHooks()
        self._sp_state: StepState | None = None
        self._sp_proposer = None
        self._sp_stats = TreeStats()
        # the method's budget (engine/budget): pinned until the method loads
        self._sp_budget: BudgetController | FixedBudget = FixedBudget()
        isolation = self._sp_options.get("isolation", "salt")
        logger.info("specplug: isolation=%s (%s)", isolation, ISOLATION_SHARES[isolation])

    def load_model(self, *args, **kwargs) -> None:
        # the target's (and a drafter's) linear layers on the small-row CPU
        # kernel where it is bitwise equal to vLLM's (kernels/cpu_linear.py)
        with cpu_linear_routing(self.device.type == "cpu") as linear_kernel:
            self._sp_load_model(linear_kernel, *args, **kwargs)

    def _sp_load_model(self, linear_kernel: bool, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._sp_target.linear_routed = []
        if linear_kernel:
            from vllm_specplug.kernels.cpu_linear import take_routed

            self._sp_target.linear_routed = take_routed()
            logger.info("specplug: %d of the target's linear layers on the CPU linear "
                        "kernel for small steps (%s)", len(self._sp_target.linear_routed),
                        ", ".join(sorted(set(self._sp_target.linear_routed))) or "none qualified")
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
        self._sp_target.aux_index = {}
        # What of the method shapes the compiled graph: the compile cache is
        # keyed by it, not by the method's options (plugin._hash_graph_not_options).
        graph = {"aux_layers": sorted(set(layers))}
        if self._sp_target.linear_routed:  # the graph calls specplug::cpu_linear there
            graph["cpu_linear"] = self._sp_target.linear_routed
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
        self._sp_target.aux_index = {x: i for i, x in enumerate(union)}

    def _sp_install_attention(self) -> None:
        from vllm.model_executor.layers.attention import Attention

        dev = self.device.type
        check_engine_config(self.vllm_config, self._sp_method)
        ctx = self.compilation_config.static_forward_context
        check_layers(ctx, dev, self.speculative_config.num_speculative_tokens)
        mode = check_graph_mode(self.compilation_config, dev)
        self._sp_target.kv_layout = "gpu" if dev == "cuda" else TreeAttentionWrapper.layout
        self._sp_target.head_size = None
        for name, layer in ctx.items():
            if not isinstance(layer, Attention):
                continue
            impl = layer.impl
            self._sp_target.head_size = impl.head_size
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
            self._sp_target.kv_layout = found
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
