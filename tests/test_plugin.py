"""The plugin's contract with vLLM: names, options, errors, other methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import engine, greedy


def _create(spec: dict, model: str):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.plugin import register

    register()
    return EngineArgs(model=model, speculative_config=spec, dtype="float32",
                      max_model_len=512).create_engine_config()


@pytest.mark.parametrize("spec, message", [
    ({"method": "pld", "num_speculative_tokens": 4, "bogus": 1},
     "unknown key 'bogus' for method 'pld'"),
    ({"method": "pld", "num_speculative_tokens": 4, "prompt_lookup_max": "4"},
     "speculative_config['prompt_lookup_max']: Input should be a valid integer"),
    ({"method": "pld", "num_speculative_tokens": 4, "prompt_lookup_max": 0},
     "speculative_config['prompt_lookup_max']: Input should be greater than or equal to 1"),
    ({"method": "pld", "num_speculative_tokens": 4, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "speculative_config['prompt_lookup_min']=5 must be <="),
    ({"method": "pld", "num_speculative_tokens": 2, "tree_branches": 3},
     "speculative_config['tree_branches']=3 exceeds num_speculative_tokens=2"),
])
def test_bad_option_is_a_one_line_error(tiny_model, spec, message):
    from vllm_specplug.config import SpecplugConfigError

    with pytest.raises(SpecplugConfigError) as err:
        _create(spec, tiny_model)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_specplug_method_becomes_custom_class_with_own_worker(tiny_model):
    cfg = _create({"method": "pld", "num_speculative_tokens": 5,
                   "prompt_lookup_max": 3}, tiny_model)
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.num_speculative_tokens == 5
    assert cfg.parallel_config.worker_cls.startswith("vllm_specplug.runner.")
    assert cfg.additional_config["specplug"] == {
        "method": "pld",
        "options": {"cost_aware": True, "max_request_faults": 3, "max_draft_ms": 50.0, "isolation": "salt",
                    "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                    "tree_branches": 1, "branch_len": 4},
    }


def test_vllm_method_untouched(tiny_model):
    cfg = _create({"method": "ngram", "num_speculative_tokens": 3,
                   "prompt_lookup_max": 2}, tiny_model)
    assert cfg.speculative_config.method == "ngram"
    assert "specplug" not in cfg.additional_config
    assert not cfg.parallel_config.worker_cls.startswith("vllm_specplug")


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.plugin import register

    register()
    first = EngineArgs.create_engine_config
    register()
    assert EngineArgs.create_engine_config is first


def test_other_vllm_version_fails_in_one_line(monkeypatch):
    import vllm

    from vllm_specplug.version import check_vllm_version

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv("SPECPLUG_ALLOW_ANY_VLLM", raising=False)
    with pytest.raises(RuntimeError, match="tested on vLLM 0.32.0 only, found 0.99.0"):
        check_vllm_version()
    monkeypatch.setenv("SPECPLUG_ALLOW_ANY_VLLM", "1")
    check_vllm_version()


@pytest.mark.engine
def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("specplug") == "vllm_specplug.plugin:register"


_CHILD = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        spec = {"method": "pld", "num_speculative_tokens": 4, "prompt_lookup_max": 2}
        llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256,
                  enforce_eager=True, speculative_config=spec)
        out = llm.generate(["a b a b a b"], SamplingParams(max_tokens=8, ignore_eos=True))
        stats = llm.collective_rpc("specplug_stats")
        print("RESULT", json.dumps({"n": len(out[0].outputs[0].token_ids),
                                    "steps": stats[0]["steps"]}))
""")


# slow: a process and an engine of its own. Every `specplug serve` test runs
# vLLM multiprocess (the OpenAI server's engine core is always a process of
# its own) with the plugin loaded from its entry point in each process, and
# tests/serving/test_per_request_spec_metrics.py reads the worker's
# specplug_stats back over RPC, equal to the front end's counters
@pytest.mark.slow
@pytest.mark.engine
def test_plugin_loads_in_engine_core_and_worker_processes(tiny_model, tmp_path):
    """Multiprocess engine: the name is rewritten in the front end and the
    specplug worker runs in the worker process (its stats come back over RPC)."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    proc = subprocess.run([sys.executable, str(script), tiny_model], env=env,
                          capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    result = json.loads(line[0].split(" ", 1)[1])
    assert result["n"] == 8 and result["steps"] > 0


@pytest.mark.engine
def test_numba_imported_before_engine_start(tiny_model):
    """vLLM 0.32 pitfall: after numba is imported (vLLM's own ngram does it),
    a CPU worker start fails in the kernel dispatcher unless the plugin
    hides numba from it (``plugin._ModulesWithoutLlvm``)."""
    import numba  # noqa: F401

    spec = {"method": "pld", "num_speculative_tokens": 3}
    with engine(tiny_model, spec, max_model_len=256) as llm:
        assert len(greedy(llm, [[5, 6, 7, 5, 6]], 4)[0]) == 4


def test_num_speculative_tokens_defaults_to_the_registry_cap():
    """`{"method": "pld"}` alone is a complete config: vLLM gets the default cap."""
    from vllm_specplug import registry

    _, _, vllm_keys = registry.resolve({"method": "pld"})
    assert vllm_keys == {"num_speculative_tokens": 16}
    _, _, vllm_keys = registry.resolve({"method": "pld", "num_speculative_tokens": 4})
    assert vllm_keys == {"num_speculative_tokens": 4}
