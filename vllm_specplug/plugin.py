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

import copy
import json
import logging
import os

from vllm_specplug import registry
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY, GRAPH_KEY
from vllm_specplug.tenancy import ISOLATION_SHARES, install_engine_core_hook

# A child of vLLM's logger, so the line shows with vLLM's own start-up log.
logger = logging.getLogger("vllm.specplug")

_DRAFTER = "vllm_specplug.runner.runner.SpecplugDrafter"
_WORKERS = {
    "cpu": "vllm_specplug.runner.cpu_worker.SpecplugCPUWorker",
    "cuda": "vllm_specplug.runner.gpu_worker.SpecplugGPUWorker",
}


def register() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.metrics import install_stats_hooks

    _guard_kernel_rebind()
    _fix_compile_cache()
    _hash_graph_not_options()
    _validate_specplug_requests()
    install_engine_core_hook()
    install_stats_hooks()
    if getattr(EngineArgs.create_engine_config, "_specplug", False):
        return
    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        spec = self.speculative_config
        if isinstance(spec, str):
            spec = json.loads(spec)
        if not isinstance(spec, dict):
            return original(self, *args, **kwargs)
        graphs = self.compilation_config
        specplug = registry.is_registered(spec.get("method"))
        if specplug:
            new = rewrite(spec, self.worker_cls, self.additional_config)
            graphs = cuda_graph_mode(self.compilation_config, spec.get("method"))
        elif spec.get("method") == "eagle3" and not spec.get("model"):
            new = (_with_default_eagle3_head(spec, str(self.model)), self.worker_cls,
                   self.additional_config)
        else:
            if spec.get("method") == "eagle3":
                _check_eagle3_head(str(spec["model"]), str(self.model))
            return original(self, *args, **kwargs)
        saved = (self.speculative_config, self.worker_cls, self.additional_config,
                 self.compilation_config)
        (self.speculative_config, self.worker_cls, self.additional_config,
         self.compilation_config) = (*new, graphs)
        try:
            config = original(self, *args, **kwargs)
        finally:
            (self.speculative_config, self.worker_cls, self.additional_config,
             self.compilation_config) = saved
        if specplug:
            check_engine_config(config)
        return config

    create_engine_config._specplug = True
    EngineArgs.create_engine_config = create_engine_config


def relaxed_refusal(params) -> str | None:
    """Why a request cannot be served under a method's LOSSY relaxed
    verification (``relaxed_lossy``), or None: it is greedy only, and
    logprobs or penalties would expose or fight the relaxed choice."""
    from vllm_specplug.runner.runner import _chain_only

    if params.temperature != 0.0:
        return "only greedy requests (temperature 0) are served"
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return "requests with logprobs are not served"
    if _chain_only(params):
        return "requests with penalties, logit bias or constraints are not served"
    return None


def check_request(params, spec: dict) -> None:
    """Refuse, with a ``VLLMValidationError`` naming the field (an HTTP 400
    in the server), a request this specplug engine (``spec``: its
    ``additional_config`` entry) cannot serve as asked: a bad ``specplug_*``
    extension field (``request_flags``), an opt-in to relaxed verification
    the server does not allow, or a request relaxed verification would
    apply to but cannot serve (``relaxed_refusal``)."""
    from vllm.exceptions import VLLMValidationError

    from vllm_specplug import request_flags as flags

    extra = params.extra_args
    try:
        flags.check_extra_args(extra)
    except flags.RequestFlagError as e:
        raise VLLMValidationError(str(e), parameter=e.field) from None
    mode = spec.get("options", {}).get("relaxed_lossy") or False
    if flags.asked_relaxed(extra) and not mode:
        raise VLLMValidationError(
            f"vllm_xargs['{flags.RELAXED}']: method '{spec.get('method')}' on this server "
            "does not allow relaxed (LOSSY) verification", parameter=flags.RELAXED)
    if not flags.wants_relaxed(extra, mode):
        return
    problem = relaxed_refusal(params)
    if problem:
        opted_in = flags.asked_relaxed(extra)
        how = (f"vllm_xargs['{flags.RELAXED}'] asks for" if opted_in
               else "speculative_config['relaxed_lossy'] is on:")
        raise VLLMValidationError(
            f"{how} LOSSY greedy-only verification: {problem}",
            parameter=flags.RELAXED if opted_in else "temperature")


def _validate_specplug_requests() -> None:
    """Request validation in the front end (``check_request``), wrapped
    around vLLM's own; it runs in the API server process and, offline, in
    the caller's, on every request, so it stays cheap. Engines without a
    specplug method are left alone (other plugins may use the same
    extension field names)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor._validate_params, "_specplug", False):
        return
    original = InputProcessor._validate_params

    def _validate_params(self, params, *args, **kwargs):
        out = original(self, params, *args, **kwargs)
        spec = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if isinstance(params, SamplingParams) and isinstance(spec, dict):
            check_request(params, spec)
        return out

    _validate_params._specplug = True
    InputProcessor._validate_params = _validate_params


def _with_default_eagle3_head(spec: dict, model: str) -> dict:
    """vLLM's own ``eagle3`` without a ``model``: the head specplug ships for
    this target's shape (for the reference model: the one in the package)."""
    from vllm_specplug.eagle3 import default_head_for

    head = default_head_for(model)
    if head is None:
        raise ValueError(
            "speculative_config method 'eagle3' needs 'model' (a draft head folder); "
            f"specplug ships no head for {model} (train one with "
            "`specplug eagle3 generate-data` and `specplug eagle3 train`)")
    return {**spec, "model": head}


def cuda_graph_mode(compilation_config, method: str):
    """The compilation config a specplug method runs with on CUDA.

    Tree verification recomputes the tree rows in Python around vLLM's
    attention op every step. vLLM's default FULL_AND_PIECEWISE replays a full
    CUDA graph for uniform decode batches (every request 1+k tokens), captured
    without any tree: tree rows would attend to their siblings and the KV move
    would be skipped. PIECEWISE keeps the attention op outside the graphs.
    An explicit full-graph mode is refused; NONE and PIECEWISE are kept.
    """
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.platforms import current_platform

    if current_platform.device_type != "cuda":
        return compilation_config
    if isinstance(compilation_config, dict):
        compilation_config = CompilationConfig(**compilation_config)
    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        raise ValueError(
            f"specplug method '{method}' cannot verify trees inside full CUDA graphs "
            f"(cudagraph_mode={mode.name}); use PIECEWISE (the specplug default) or NONE")
    if mode is None:
        compilation_config = copy.deepcopy(compilation_config)
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        logger.info("specplug: cudagraph_mode=PIECEWISE (tree attention runs outside "
                    "CUDA graphs; full graphs would skip it)")
    return compilation_config


def _check_eagle3_head(head: str, model: str) -> None:
    """A specplug-trained head records its target's shape: refuse a head made
    for another target or vocabulary in one line, instead of a shape error
    deep in vLLM's loader."""
    import os

    from vllm_specplug.config import SpecplugConfigError
    from vllm_specplug.eagle3 import TARGET_MATCH_KEYS, target_config

    meta_path = os.path.join(head, "specplug_eagle3.json")
    if not os.path.isfile(meta_path):
        return  # not a specplug head: vLLM checks it
    try:
        with open(meta_path, encoding="utf-8") as f:
            recorded = json.load(f).get("target_config", {})
        target = target_config(model)
    except (OSError, ValueError):
        return
    diff = [f"{k}={recorded.get(k)} (target: {target.get(k)})" for k in TARGET_MATCH_KEYS
            if k in recorded and recorded.get(k) != target.get(k)]
    if diff:
        raise SpecplugConfigError(
            f"speculative_config['model']: EAGLE-3 head {head} was trained for another "
            f"target: {', '.join(diff)}")


def check_engine_config(config) -> None:
    """Start-up checks that need the engine's whole config (model, cache,
    scheduler), run in the front end before any engine process starts; the
    worker runs the same ``runner.checks`` again on the config it gets.
    Every failure is one line naming the key."""
    from vllm_specplug.runner.checks import check_engine_config as check_config

    spec = config.additional_config[ADDITIONAL_CONFIG_KEY]
    method = spec["method"]
    check_config(config, method)
    registry.get(method).config_cls(**spec["options"]).check_engine(config)


def rewrite(spec: dict, worker_cls: str, additional: dict | None):
    """A specplug speculative_config -> (what vLLM gets as speculative_config,
    worker class, additional_config)."""
    from vllm.platforms import current_platform

    from vllm_specplug.version import check_vllm_version

    check_vllm_version()
    method, config, vllm_keys = registry.resolve(spec)
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
    logger.info("specplug: isolation=%s (%s)", config.isolation,
                ISOLATION_SHARES[config.isolation])
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
       same model would compile its C++ kernels from scratch. Inductor's
       caches are keyed by content (torch's default is one folder for
       everything), so the plugin points them at one folder per vLLM cache
       root: a new configuration reuses the compiled kernels (after a few
       configurations of a model, a new one adds none). Tracing
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


def _hash_graph_not_options() -> None:
    """Let every specplug configuration of one target share its compiled model.

    vLLM keys its compile cache by ``VllmConfig.compute_hash()``, which
    hashes ``additional_config`` whole, so each method and each option value
    (a tree size, a threshold) would be a cache miss: 70-180 s of compiling
    on a 2-core CPU per new configuration, an hour for a 22-point option
    sweep. The method changes the target's graph in one way only: the
    hidden-state layers it asks the model to return. The runner records them
    under ``GRAPH_KEY`` when it installs the capture (before the first
    forward compiles); from then on the hash sees those layers instead of
    the method and its options. Until they are recorded the whole entry is
    hashed, as vLLM does: a miss, never a wrong load.
    """
    from vllm.config import VllmConfig

    original = VllmConfig.compute_hash
    if getattr(original, "_specplug", False):
        return

    def compute_hash(self, *args, **kwargs):
        extra = self.additional_config
        spec = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
        if not (isinstance(spec, dict) and GRAPH_KEY in spec):
            return original(self, *args, **kwargs)
        self.additional_config = {**extra, ADDITIONAL_CONFIG_KEY: {GRAPH_KEY: spec[GRAPH_KEY]}}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.additional_config = extra

    compute_hash._specplug = True
    VllmConfig.compute_hash = compute_hash


def shared_inductor_cache() -> str:
    """The inductor cache folder every compiled engine shares (under
    ``VLLM_CACHE_ROOT``)."""
    import vllm.envs as envs

    path = os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "inductor_shared")
    os.makedirs(path, exist_ok=True)
    return path
