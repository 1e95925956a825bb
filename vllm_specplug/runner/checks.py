"""Start-up refusals: everything tree verification cannot do right is a
one-line error before the engine serves, never wrong output later.

One place for all of them. ``check_engine_config`` (config-level) runs twice
with the same code: in the front end (``plugin.create_engine_config``, before
any engine process starts, so ``vllm serve`` fails at once) and again in the
worker (``SpecplugRunnerMixin``), where the config is the one the engine
really runs with. ``check_layers`` / ``check_graph_mode`` /
``check_kv_groups`` need the loaded model, the compilation config or the KV
cache layout and run only in the worker.
"""

from __future__ import annotations

from vllm_specplug.config import SpecplugConfigError

# The Triton tree kernel packs a node's ancestors into one int64.
MAX_GPU_TREE_NODES = 64


def check_engine_config(config, method: str) -> None:
    """Every refusal that needs only the engine config (``VllmConfig``)."""
    check_budget(config)
    check_kv_cache(config.cache_config, method)
    check_model(config.model_config, method)
    check_parallel(config.parallel_config)
    check_model_runner(config)
    check_cpu_dtype(config.model_config)


def check_budget(config) -> None:
    n = config.speculative_config.num_speculative_tokens
    budget = config.scheduler_config.max_num_batched_tokens
    if n + 1 > budget:
        raise SpecplugConfigError(
            f"speculative_config['num_speculative_tokens']={n}: a draft needs {n + 1} "
            f"tokens per request per step, more than max_num_batched_tokens={budget}")
    max_len = config.model_config.max_model_len
    if n + 1 >= max_len:
        raise SpecplugConfigError(
            f"speculative_config['num_speculative_tokens']={n} leaves no room in "
            f"max_model_len={max_len}")


def check_kv_cache(cache_config, method: str) -> None:
    # Tree rows read the context K/V back from the paged cache and attend in
    # the model's dtype: a cache in another dtype (fp8, ...) is refused
    # rather than read wrongly.
    dtype = cache_config.cache_dtype
    if dtype not in ("auto", None):
        raise SpecplugConfigError(
            f"kv_cache_dtype='{dtype}': specplug tree verification needs "
            f"kv_cache_dtype='auto' (method '{method}')")


def check_model(model_config, method: str) -> None:
    if getattr(model_config, "uses_mrope", False) or getattr(
            model_config, "uses_xdrope_dim", 0):
        raise SpecplugConfigError(
            "specplug tree verification does not support M-RoPE models (tree "
            "positions are written to 1-D positions only)")
    window = (model_config.get_sliding_window()
              if hasattr(model_config, "get_sliding_window") else None)
    hf = getattr(model_config, "hf_text_config", None)
    for key, bad in (("sliding_window", window is not None),
                     ("attn_logit_softcapping", getattr(hf, "attn_logit_softcapping", None)),
                     ("alibi", getattr(hf, "alibi", False) or getattr(hf, "use_alibi", False))):
        if bad:
            raise SpecplugConfigError(
                f"model config '{key}': specplug tree verification does not support "
                f"sliding-window attention, ALiBi or logit soft-capping (method '{method}')")


def check_parallel(parallel_config) -> None:
    pp = parallel_config.pipeline_parallel_size
    if pp > 1:
        raise SpecplugConfigError(
            f"specplug does not support pipeline parallelism (pipeline_parallel_size={pp})")
    # Context parallelism spreads a request's KV over ranks (decode: slots
    # interleaved, non-local ones padded); the tree kernels read the whole
    # context from the local cache, so they would attend to the wrong keys.
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel_config, key, 1)
        if size > 1:
            raise SpecplugConfigError(
                f"specplug does not support context parallelism ({key}={size})")
    # Micro-batching splits a step's batch in two forward passes; the tree
    # rows of one step are laid out for a single pass.
    dbo = getattr(parallel_config, "enable_dbo", False)
    ubatch = getattr(parallel_config, "ubatch_size", 0)
    if dbo or ubatch > 1:
        raise SpecplugConfigError(
            "specplug does not support dual-batch overlap / micro-batching "
            f"(enable_dbo={dbo}, ubatch_size={ubatch})")


def check_model_runner(config) -> None:
    """The specplug workers build vLLM's V1 model runner; an engine that
    believes it runs V2 (its scheduler and input processing follow that
    flag) would not match it."""
    if getattr(config, "use_v2_model_runner", False):
        raise SpecplugConfigError(
            "specplug needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER "
            "(or set it to 0)")


def check_cpu_dtype(model_config) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    if getattr(model_config, "dtype", None) == torch.bfloat16 and \
            torch.cpu._is_amx_tile_supported():
        raise SpecplugConfigError(
            "dtype='bfloat16': on this CPU (AMX) vLLM's attention cache uses a "
            "packed layout tree verification cannot read; use --dtype float32")


def check_layers(layers: dict, device_type: str, num_speculative_tokens: int) -> None:
    """Refuse, at start-up and in one line, what tree verification cannot do
    right. ``layers``: the model's static forward context (name -> module)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    if device_type == "cuda" and num_speculative_tokens > MAX_GPU_TREE_NODES:
        raise SpecplugConfigError(
            f"specplug on GPU verifies trees of at most {MAX_GPU_TREE_NODES} nodes; "
            f"num_speculative_tokens={num_speculative_tokens}")
    for name, layer in layers.items():
        if not isinstance(layer, AttentionLayerBase):
            continue  # MoE and other no-compile layers
        if type(layer) is not Attention:
            # MLA, Mamba/linear attention, chunked-local, sink, cross/encoder...
            raise SpecplugConfigError(
                f"specplug tree verification does not support {type(layer).__name__} "
                f"layers ({name})")
        impl = layer.impl
        sw = getattr(impl, "sliding_window", None)
        # CPU backend: -1 = none; FLASH_ATTN/TRITON_ATTN: (-1, -1) = none.
        if sw not in (None, -1, (-1, -1)):
            raise SpecplugConfigError(
                f"specplug tree verification does not support sliding-window "
                f"attention ({name}, window {sw})")
        if getattr(impl, "alibi_slopes", None) is not None or getattr(
                impl, "logits_soft_cap", 0):
            raise SpecplugConfigError(
                f"specplug tree verification does not support ALiBi or logit "
                f"soft-capping ({name})")
        if getattr(impl, "sinks", None) is not None:
            raise SpecplugConfigError(
                f"specplug tree verification does not support attention sinks ({name})")
        if getattr(impl, "attn_type", "decoder") != "decoder":
            raise SpecplugConfigError(
                f"specplug tree verification supports decoder attention only "
                f"({name}: {impl.attn_type})")
        if device_type == "cuda" and type(impl).__name__ not in (
                "FlashAttentionImpl", "TritonAttentionImpl"):
            raise SpecplugConfigError(
                f"specplug tree verification on GPU supports the FLASH_ATTN and "
                f"TRITON_ATTN backends, not {type(impl).__name__}")
        if not hasattr(impl, "do_kv_cache_update"):
            raise SpecplugConfigError(
                f"specplug needs the attention backend's KV writer "
                f"({type(impl).__name__} has no do_kv_cache_update)")


def check_graph_mode(compilation_config, device_type: str) -> str:
    """The CUDA graph mode name; refuses full graphs on GPU (they replay
    decode batches without the tree attention, see plugin.cuda_graph_mode)."""
    mode = compilation_config.cudagraph_mode
    name = getattr(mode, "name", str(mode))
    if device_type == "cuda" and mode is not None and mode.has_full_cudagraphs():
        raise SpecplugConfigError(
            f"specplug cannot verify trees inside full CUDA graphs (cudagraph_mode="
            f"{name}); use PIECEWISE or NONE")
    return name


def check_kv_groups(kv_cache_config) -> None:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise SpecplugConfigError(
            f"specplug tree verification supports one KV-cache group, the model has "
            f"{len(groups)} (hybrid or mixed-attention models)")
