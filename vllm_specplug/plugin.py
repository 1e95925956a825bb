"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register`` in every process it starts (front end, engine core,
workers), possibly more than once. It fixes two vLLM 0.32 CPU pitfalls that
hit every engine, specplug or not (the kernel dispatcher and numba, the
compile cache; see the functions below), and wraps
``EngineArgs.create_engine_config``: when ``speculative_config["method"]``
names a specplug method, the method's options are validated here (one-line
errors at start-up) and the config handed to vLLM becomes a ``custom_class``
speculative config, a specplug worker class, and the method's options in
``additional_config`` (which travels, pickled, to every worker).
"""

from __future__ import annotations

import json
import os

from vllm_specplug import registry
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY

_DRAFTER = "vllm_specplug.runner.runner.SpecplugDrafter"
_WORKERS = {
    "cpu": "vllm_specplug.runner.cpu_worker.SpecplugCPUWorker",
    "cuda": "vllm_specplug.runner.gpu_worker.SpecplugGPUWorker",
}


def register() -> None:
    from vllm.engine.arg_utils import EngineArgs

    _guard_kernel_rebind()
    _fix_compile_cache()
    if getattr(EngineArgs.create_engine_config, "_specplug", False):
        return
    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        spec = self.speculative_config
        if isinstance(spec, str):
            spec = json.loads(spec)
        if not isinstance(spec, dict):
            return original(self, *args, **kwargs)
        if registry.is_registered(spec.get("method")):
            new = rewrite(spec, self.worker_cls, self.additional_config)
        elif spec.get("method") == "eagle3" and not spec.get("model"):
            new = (_with_default_eagle3_head(spec, str(self.model)), self.worker_cls,
                   self.additional_config)
        else:
            return original(self, *args, **kwargs)
        saved = (self.speculative_config, self.worker_cls, self.additional_config)
        self.speculative_config, self.worker_cls, self.additional_config = new
        try:
            return original(self, *args, **kwargs)
        finally:
            self.speculative_config, self.worker_cls, self.additional_config = saved

    create_engine_config._specplug = True
    EngineArgs.create_engine_config = create_engine_config


def _with_default_eagle3_head(spec: dict, model: str) -> dict:
    """vLLM's own ``eagle3`` without a ``model``: the head specplug ships for
    this target's shape (for the reference model: the one trained here)."""
    from vllm_specplug.eagle3 import default_head_for

    head = default_head_for(model)
    if head is None:
        raise ValueError(
            "speculative_config method 'eagle3' needs 'model' (a draft head folder); "
            f"specplug ships no head for {model} (train one with "
            "`specplug eagle3 generate-data` and `specplug eagle3 train`)")
    return {**spec, "model": head}


def rewrite(spec: dict, worker_cls: str, additional: dict | None):
    """A specplug speculative_config -> (what vLLM gets as speculative_config,
    worker class, additional_config)."""
    from vllm.platforms import current_platform

    from vllm_specplug.config import split_speculative_config
    from vllm_specplug.version import check_vllm_version

    check_vllm_version()
    method, config, vllm_keys = split_speculative_config(spec)
    device = current_platform.device_type
    if device not in _WORKERS:
        raise ValueError(f"specplug method '{method}' does not support device '{device}'")
    if worker_cls not in ("auto", _WORKERS[device]):
        raise ValueError(
            f"specplug method '{method}' needs its own worker; drop --worker-cls "
            f"({worker_cls})"
        )
    additional = dict(additional or {})
    additional[ADDITIONAL_CONFIG_KEY] = {"method": method, "options": config.to_dict()}
    vllm_spec = {**vllm_keys, "method": "custom_class", "model": _DRAFTER}
    return vllm_spec, _WORKERS[device], additional


class _ModulesWithoutLlvm:
    """``sys`` as vLLM's kernel dispatcher sees it, minus numba/llvmlite.

    vLLM 0.32's ``_rebind_kernels`` calls ``vars(x).get`` on every module
    attribute; llvmlite's ``ffi.lib`` has a non-dict ``__dict__``, so once
    numba is imported (vLLM's own ``ngram`` does it) every later CPU worker
    start in the process fails. Neither package holds vLLM kernels.
    """

    @property
    def modules(self) -> dict:
        import sys

        return {k: v for k, v in sys.modules.items()
                if not k.startswith(("llvmlite", "numba"))}


def _guard_kernel_rebind() -> None:
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if not isinstance(getattr(dispatcher, "sys", None), _ModulesWithoutLlvm):
        dispatcher.sys = _ModulesWithoutLlvm()


def _finalize_loaded_inductor_artifact(self, vllm_config) -> None:
    """Nothing to do: torch deserialized this artifact completely."""


def _fix_compile_cache() -> None:
    """Make vLLM's compile cache work on CPU (vLLM 0.32, torch 2.13).

    1. Loading. On CPU vLLM compiles with torch's own ``inductor`` backend
       (``CpuPlatform`` sets ``DYNAMO_TRACE_ONCE`` + ``"inductor"``), so the
       saved AOT artifact's compiled function is torch's
       ``BundledAOTAutogradSerializableCallable``, complete once torch has
       deserialized it. vLLM's loader (``decorators._try_load_aot_compiled_fn``)
       then calls ``finalize_loading``, which only vLLM's own
       ``VllmSerializableFunction`` (its GPU backend) has; the wrapper forwards
       the lookup to the inner plain function, the ``AttributeError`` counts
       as a load failure, and every start recompiles the model ("'function'
       object has no attribute 'finalize_loading'"). A no-op
       ``finalize_loading`` on torch's class makes the load succeed.
    2. Sharing. vLLM points inductor's cache at one folder per AOT hash, and
       that hash covers the whole engine config (speculative config, method
       options, ``max_num_seqs``, ...), so every new configuration of the
       same model also compiled its C++ kernels from scratch. Inductor's
       caches are keyed by content (torch's default is one folder for
       everything), so the plugin points them at one folder per vLLM cache
       root: a new configuration reuses the compiled kernels (seen here: the
       5th configuration of the reference model added no kernel). Tracing
       and lowering still run for it: their cache key differs between
       engine configurations.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
        from vllm.compilation import decorators
    except ImportError:
        return
    if "finalize_loading" not in vars(BundledAOTAutogradSerializableCallable):
        BundledAOTAutogradSerializableCallable.finalize_loading = (
            _finalize_loaded_inductor_artifact)
    load = decorators._try_load_aot_compiled_fn
    if getattr(load, "_specplug", False):
        return

    def _try_load_aot_compiled_fn(model, aot_compilation_path):
        # vLLM set TORCHINDUCTOR_CACHE_DIR to this hash's folder just before;
        # what follows (load, or compile on a miss) uses the shared one.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = shared_inductor_cache()
        return load(model, aot_compilation_path)

    _try_load_aot_compiled_fn._specplug = True
    decorators._try_load_aot_compiled_fn = _try_load_aot_compiled_fn


def shared_inductor_cache() -> str:
    """The inductor cache folder every compiled engine shares (under
    ``VLLM_CACHE_ROOT``)."""
    import vllm.envs as envs

    path = os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "inductor_shared")
    os.makedirs(path, exist_ok=True)
    return path
