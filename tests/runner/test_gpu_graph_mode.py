"""The engine config a specplug method gets on CUDA keeps the tree attention
out of CUDA graphs.

vLLM's default on CUDA is FULL_AND_PIECEWISE: a batch where every request has
1+k tokens replays a full graph captured with no tree step (tree rows would
see their siblings, the KV move would never run). The plugin sets PIECEWISE,
under which vLLM's attention op runs eagerly between graph pieces, so the
wrapper runs every step. The CUDA platform is faked (no GPU here): only the
device type, static-graph support and the platform's own config hook (which
needs CUDA libraries) are replaced; vLLM's config resolution is real.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_cuda(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cls = type(current_platform)
    monkeypatch.setattr(cls, "device_type", "cuda")
    monkeypatch.setattr(cls, "support_static_graph_mode", classmethod(lambda c: True))
    monkeypatch.setattr(cls, "check_and_update_config", classmethod(lambda c, cfg: None))


def _config(model, spec=None, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, speculative_config=spec, dtype="float32",
                      max_model_len=512, **kw)
    return args.create_engine_config()


def test_plugin_sets_piecewise_on_cuda(tiny_model, fake_cuda):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_specplug.runner.checks import check_graph_mode

    # Without specplug this (faked) CUDA config would capture full graphs.
    plain = _config(tiny_model)
    assert plain.compilation_config.cudagraph_mode.has_full_cudagraphs()
    cfg = _config(tiny_model, {"method": "pld", "num_speculative_tokens": 4})
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert cfg.parallel_config.worker_cls.endswith("SpecplugGPUWorker")
    # ... which the runner's own start-up check accepts.
    assert check_graph_mode(cfg.compilation_config, "cuda") == "PIECEWISE"


def test_explicit_full_graphs_refused_and_eager_kept(tiny_model, fake_cuda):
    from vllm.config.compilation import CUDAGraphMode

    spec = {"method": "pld", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="full CUDA graphs"):
        _config(tiny_model, spec, compilation_config={"cudagraph_mode": "FULL"})
    cfg = _config(tiny_model, spec, enforce_eager=True)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
