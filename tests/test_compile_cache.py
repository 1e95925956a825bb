"""vLLM's compile cache on CPU (``vllm_specplug.plugin._fix_compile_cache``).

Without the plugin's fix, vLLM 0.32 with torch 2.13 recompiles the model on
every CPU engine start ("Compiling model again due to a load failure ...
'function' object has no attribute 'finalize_loading'"). With it, a second start of the
same configuration in a fresh process loads the compiled model instead:
vLLM's own compilation counters say which happened.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import run_isolated

pytestmark = pytest.mark.engine

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def _start(model: str, spec: dict | None, cache_root: str | None, max_num_seqs: int = 4):
    """One compiled engine start in this (fresh) process: how it got its
    compiled model, how long ``LLM()`` took, and a greedy output."""
    import time

    if cache_root:
        os.environ["VLLM_CACHE_ROOT"] = cache_root
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.compilation.counter import compilation_counter

    from tests.conftest import shutdown

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0,
              max_num_seqs=max_num_seqs, speculative_config=spec)
    seconds = time.perf_counter() - t0
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    shutdown(llm)
    return {"seconds": seconds, "compiles": compilation_counter.num_aot_compiles,
            "loaded": compilation_counter.num_aot_artifacts_loaded,
            "tokens": list(out[0].outputs[0].token_ids)}


def test_second_start_loads_the_compiled_model(tiny_model):
    """Two starts in fresh processes (vLLM's usual cache folder, like every
    user): the first compiles or loads, the second must load."""
    first = run_isolated(_start, tiny_model, None, None)
    second = run_isolated(_start, tiny_model, None, None)
    assert first["compiles"] + first["loaded"] == 1, first
    assert second["loaded"] == 1 and second["compiles"] == 0, second
    assert second["tokens"] == first["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_reference_model_second_start_under_30s(ref_model, tmp_path):
    """What a user waits for: the reference model with a tree method, from an empty
    cache. First start compiles (minutes on 2 cores); the second loads, and
    ``LLM()`` takes under 30 s on an otherwise idle machine. A new
    configuration of the same model (another ``max_num_seqs``: another
    compile-cache entry) compiles again, reusing the compiled kernels."""
    spec = {"method": "pld", "num_speculative_tokens": 8, "tree_branches": 3}
    root = str(tmp_path / "vllm_cache")
    first = run_isolated(_start, ref_model, spec, root)
    second = run_isolated(_start, ref_model, spec, root)
    other = run_isolated(_start, ref_model, spec, root, 8)
    print({"first": first["seconds"], "second": second["seconds"],
           "new_config": other["seconds"]})
    assert first["compiles"] == 1 and first["loaded"] == 0
    assert second["loaded"] == 1 and second["compiles"] == 0
    assert second["tokens"] == first["tokens"] == other["tokens"]
    assert second["seconds"] < 30, second
    assert other["compiles"] == 1  # its own cache entry (kernels reused)


@pytest.mark.slow  # seconds of start-up, not correctness; test_compile_hash.py checks the key
def test_option_changes_share_the_compiled_model(tiny_model, tmp_path):
    """A specplug method's options do not change the target's graph, so
    another tree size or option value loads the model the first start
    compiled (``plugin._hash_graph_not_options``); a method that captures
    hidden layers (``adapld``) changes the graph and gets its own entry."""
    root = str(tmp_path / "vllm_cache")
    first = run_isolated(_start, tiny_model,
                         {"method": "pld", "num_speculative_tokens": 4}, root)
    options = run_isolated(_start, tiny_model,
                           {"method": "recycle", "num_speculative_tokens": 8,
                            "cost_aware": False}, root)
    assert first["compiles"] == 1 and first["loaded"] == 0, first
    assert options["loaded"] == 1 and options["compiles"] == 0, options
    assert options["tokens"] == first["tokens"]  # both lossless
    captured = run_isolated(_start, tiny_model,
                            {"method": "adapld", "num_speculative_tokens": 4}, root)
    assert captured["compiles"] == 1 and captured["loaded"] == 0, captured
