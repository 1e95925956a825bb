"""Shared test set-up: vLLM in-process, float32, and engine helpers.

The environment must be set before vLLM is imported anywhere.
"""

from __future__ import annotations

import contextlib
import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@contextlib.contextmanager
def engine(model: str, spec: dict | None = None, compiled: bool = False, **kwargs):
    """A real vLLM engine (float32, eager unless ``compiled``), torn down
    afterwards so several can run in one process.

    ``compiled=True`` runs the model the way users get it (torch.compile,
    vLLM's default); its first start with a configuration compiles, later
    ones load vLLM's compile cache (``VLLM_CACHE_ROOT``)."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    opts = dict(dtype="float32", max_model_len=1024, enforce_eager=not compiled, seed=0,
                disable_log_stats=False)
    opts.update(kwargs)
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()
    llm = LLM(model=model, speculative_config=spec, **opts)
    try:
        yield llm
    finally:
        shutdown(llm)
        del llm
        cleanup_dist_env_and_memory()  # unfreezes the heap, collects the engine
        # An engine's start and teardown ran about ten full collections
        # (vLLM's loader, profiler and shutdown), each walking the ~700k
        # objects torch, vLLM and transformers leave: about 3 s an engine.
        # With what survives a teardown frozen, the next engine's start
        # collects only its own objects. Nothing collectable is frozen: the
        # heap was just collected.
        gc.freeze()


def shutdown(llm) -> None:
    """Shut an in-process engine down now. Left to its GC finalizer, a dead
    engine's shutdown tears down the *next* engine's distributed groups
    ("pipeline model parallel group is not initialized")."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


def onednn_order_unknown_here() -> bool:
    """True where oneDNN's float32 summation order, which the CPU linear
    kernel (kernels/cpu_linear.py) must match bit for bit, has not been
    established: known on x86 without AVX-512 (an AMD EPYC with AVX2) and
    on an Intel Xeon with AVX-512/AMX (blocks of 512, or 1024 by row
    count); not on an AMD CPU with AVX-512. There the
    shapes may be refused and vLLM's own path runs (safe:
    test_routed_layers_keep_onednn_bits)."""
    from benchmarks.machine import cpu_info

    model, flags = cpu_info()
    return "avx512f" in flags and "intel" not in (model or "").lower()


def run_isolated(func, *args):
    """``func(*args)`` in a fresh spawned process. vLLM 0.32's built-in
    ``ngram`` cannot start after another engine in the same process."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(func, args)


def greedy(llm, prompts: list[list[int]], max_tokens: int, **sp) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            ignore_eos=True, **sp)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_PLAIN: dict[tuple, list[int]] = {}


def plain_greedy(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain decoding's greedy continuations (eager, float32, no draft),
    remembered for the test session per (model, prompt, max_tokens): the
    method modules compare with the same prompts, and each computed them
    again in an engine of its own (about 30 s a module). The missing ones are
    decoded together in one batch; the method tests compare with them at
    batch 1 and 8, so they already hold plain decoding batch-invariant."""
    key = lambda p: (model, tuple(p), max_tokens)  # noqa: E731
    missing = [p for p in dict.fromkeys(map(tuple, prompts)) if key(p) not in _PLAIN]
    if missing:
        with engine(model) as llm:
            for p, out in zip(missing, greedy(llm, [list(p) for p in missing], max_tokens)):
                _PLAIN[key(p)] = out
    return [list(_PLAIN[key(p)]) for p in prompts]


def spec_counters(llm) -> dict[str, float]:
    """vLLM's own spec-decode counters, summed."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_"):
            key = m.name.removeprefix("vllm:spec_decode_num_")
            if hasattr(m, "value"):
                out[key] = out.get(key, 0) + m.value
            elif hasattr(m, "values"):
                out[key] = [a + b for a, b in zip(out.get(key, [0] * len(m.values)), m.values)]
    return out


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vllm_specplug.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def ref_model() -> str:
    from vllm_specplug.models.reference import reference_model_path

    return reference_model_path()
