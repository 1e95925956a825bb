"""Start-up refusals: every model or engine feature tree verification cannot
do right is a one-line error when the runner loads, not wrong output later.

Layers are vLLM's own classes (attention impls constructed for real where
they construct on CPU; MLA/Mamba/chunked-local layers only need their type);
configs are vLLM's own config classes where they construct without a model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_specplug.runner.checks import (
    check_graph_mode,
    check_kv_cache,
    check_kv_groups,
    check_layers,
    check_model,
    check_model_runner,
    check_parallel,
)

H, HKV, D = 4, 2, 32


def _triton_impl(**kw):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    args = dict(num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=HKV,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(kw)
    with set_current_vllm_config(VllmConfig()):
        return TritonAttentionImpl(**args)


def _layer(cls, impl=None):
    """An instance of vLLM layer class ``cls`` holding ``impl`` (its
    constructor needs a model being built; the checks read type and impl)."""
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.impl = impl
    return layer


def _attention(impl):
    from vllm.model_executor.layers.attention import Attention

    return {"model.layers.0.self_attn.attn": _layer(Attention, impl)}


def test_gpu_backend_without_sliding_window_is_accepted():
    # TRITON_ATTN/FLASH_ATTN store "no window" as (-1, -1).
    impl = _triton_impl()
    assert impl.sliding_window == (-1, -1)
    check_layers(_attention(impl), "cuda", 16)


@pytest.mark.parametrize("kw,words", [
    (dict(sliding_window=128), "sliding-window"),
    (dict(sinks=torch.zeros(H)), "sinks"),
    (dict(logits_soft_cap=30.0), "soft-capping"),
    (dict(alibi_slopes=[0.5] * H), "ALiBi"),
])
def test_attention_features_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        check_layers(_attention(_triton_impl(**kw)), "cuda", 16)


def test_layer_kinds_refused():
    from vllm.model_executor.layers.attention.chunked_local_attention import (
        ChunkedLocalAttention,
    )
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    for cls in (MLAAttention, ChunkedLocalAttention, MambaMixer2):
        layers = {**_attention(_triton_impl()), "model.layers.1.x": _layer(cls)}
        with pytest.raises(ValueError, match=cls.__name__):
            check_layers(layers, "cuda", 16)


def test_gpu_backend_and_tree_size():
    impl = _triton_impl()
    impl.__class__ = type("FlashInferImpl", (type(impl),), {})
    with pytest.raises(ValueError, match="FLASH_ATTN and TRITON_ATTN"):
        check_layers(_attention(impl), "cuda", 16)
    check_layers(_attention(_triton_impl()), "cuda", 64)
    with pytest.raises(ValueError, match="at most 64 nodes"):
        check_layers(_attention(_triton_impl()), "cuda", 65)


def _vllm_config(**over):
    from vllm.config import CacheConfig, ParallelConfig

    cfg = SimpleNamespace(model_config=SimpleNamespace(uses_mrope=False),
                          parallel_config=ParallelConfig(),
                          cache_config=CacheConfig())
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_config_refusals():
    from vllm.config import CacheConfig

    cfg = _vllm_config()
    check_model(cfg.model_config, "pld")
    check_parallel(cfg.parallel_config)
    check_kv_cache(cfg.cache_config, "pld")
    with pytest.raises(ValueError, match="M-RoPE"):
        check_model(SimpleNamespace(uses_mrope=True), "pld")
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_parallel(cfg.parallel_config)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        check_kv_cache(CacheConfig(cache_dtype="fp8"), "pld")


def test_kv_cache_groups():
    from vllm.v1.kv_cache_interface import KVCacheConfig

    one = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[object()])
    check_kv_groups(one)
    two = KVCacheConfig(num_blocks=1, kv_cache_tensors=[],
                        kv_cache_groups=[object(), object()])
    with pytest.raises(ValueError, match="one KV-cache group"):
        check_kv_groups(two)


def test_full_cuda_graphs_refused():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE,
                 CUDAGraphMode.FULL_DECODE_ONLY):
        with pytest.raises(ValueError, match="full CUDA graphs"):
            check_graph_mode(CompilationConfig(cudagraph_mode=mode), "cuda")
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        assert check_graph_mode(CompilationConfig(cudagraph_mode=mode), "cuda") == mode.name


@pytest.mark.parametrize("key,value,words", [
    ("decode_context_parallel_size", 2, "decode_context_parallel_size=2"),
    ("prefill_context_parallel_size", 2, "prefill_context_parallel_size=2"),
    ("enable_dbo", True, "dual-batch overlap"),
    ("ubatch_size", 2, "micro-batching"),
])
def test_context_parallel_and_micro_batching_refused(key, value, words):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig()
    check_parallel(parallel)
    setattr(parallel, key, value)
    with pytest.raises(ValueError, match=words) as err:
        check_parallel(parallel)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("env,refused", [(None, False), ("0", False), ("1", True)])
def test_v2_model_runner_refused(monkeypatch, env, refused):
    from vllm import envs
    from vllm.config import VllmConfig

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    # built without the variable: this CPU build refuses V2 while building
    config = VllmConfig()
    # a custom_class drafter: what the plugin hands vLLM
    config.speculative_config = SimpleNamespace(
        method="custom_class", parallel_drafting=False, use_heterogeneous_vocab=False)
    if env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    if refused:
        with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER"):
            check_model_runner(config)
    else:
        check_model_runner(config)
