"""Tiny random Llama: build/caching behaviour (tmp dirs) and vLLM loading (default cache)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest

from vllm_specplug.models.reference import MANIFEST_NAME, file_lock, is_materialized, read_manifest
from vllm_specplug.models.tiny import TINY_FOLDER_NAME, TINY_RECIPE, tiny_model_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_hashes(folder: str) -> dict[str, str]:
    return {
        name: _sha(os.path.join(folder, name))
        for name in sorted(os.listdir(folder))
        if name != MANIFEST_NAME
    }


# --------------------------------------------------------------------------
# building and caching (tmp dirs)
# --------------------------------------------------------------------------


def test_build_layout(tmp_path):
    path = tiny_model_path(str(tmp_path))
    assert path == os.path.join(str(tmp_path), TINY_FOLDER_NAME)
    assert is_materialized(path)
    manifest = read_manifest(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert name in manifest["files"]
        assert os.path.getsize(os.path.join(path, name)) == manifest["files"][name]
    # nothing left behind but the folder and the lock file
    assert sorted(os.listdir(tmp_path)) == sorted([TINY_FOLDER_NAME, f".{TINY_FOLDER_NAME}.lock"])

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == 512
    assert cfg["max_position_embeddings"] == 2048
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["head_dim"] == 32
    assert cfg["rope_theta"] == TINY_RECIPE["rope_theta"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    for text in ["The capital of France is Paris.", "héllo wörld 日本語 🙂\n\tx = [1, 2]"]:
        ids = tok(text).input_ids
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert "chat_template" in json.load(f)


def test_deterministic(tmp_path):
    a = tiny_model_path(str(tmp_path / "a"))
    b = tiny_model_path(str(tmp_path / "b"))
    assert _file_hashes(a) == _file_hashes(b)


def test_idempotent(tmp_path, monkeypatch):
    path = tiny_model_path(str(tmp_path))
    st = os.stat(os.path.join(path, MANIFEST_NAME))
    dir_ino = os.stat(path).st_ino
    t0 = time.perf_counter()
    assert tiny_model_path(str(tmp_path)) == path
    assert time.perf_counter() - t0 < 0.5
    st2 = os.stat(os.path.join(path, MANIFEST_NAME))
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert os.stat(path).st_ino == dir_ino
    # default cache dir honours $SPECPLUG_CACHE
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path))
    assert tiny_model_path() == path
    assert os.stat(path).st_ino == dir_ino


@pytest.mark.parametrize("damage", ["no_marker", "missing_weights", "truncated_weights", "bad_marker", "stale_recipe"])
def test_rebuild_damaged(tmp_path, damage):
    path = tiny_model_path(str(tmp_path))
    good = _file_hashes(path)
    weights = os.path.join(path, "model.safetensors")
    marker = os.path.join(path, MANIFEST_NAME)
    if damage == "no_marker":
        os.remove(marker)
    elif damage == "missing_weights":
        os.remove(weights)
    elif damage == "truncated_weights":
        with open(weights, "r+b") as f:
            f.truncate(1000)
    elif damage == "bad_marker":
        with open(marker, "w") as f:
            f.write("{not json")
    elif damage == "stale_recipe":
        m = read_manifest(path)
        m["source"]["seed"] = -1
        with open(marker, "w") as f:
            json.dump(m, f)
    assert not is_materialized(path, {"kind": "tiny-random-llama", **TINY_RECIPE})
    dir_ino = os.stat(path).st_ino

    assert tiny_model_path(str(tmp_path)) == path
    assert is_materialized(path)
    assert os.stat(path).st_ino != dir_ino  # a fresh directory was renamed into place
    assert _file_hashes(path) == good
    assert sorted(os.listdir(tmp_path)) == sorted([TINY_FOLDER_NAME, f".{TINY_FOLDER_NAME}.lock"])


def test_rebuild_partial_folder_and_stale_tmp(tmp_path):
    # a crashed build: a partial folder without marker, plus a leftover temp dir
    partial = tmp_path / TINY_FOLDER_NAME
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    (tmp_path / f".{TINY_FOLDER_NAME}.tmp-crashed").mkdir()
    (tmp_path / f".{TINY_FOLDER_NAME}.tmp-crashed" / "junk").write_text("x")

    path = tiny_model_path(str(tmp_path))
    assert is_materialized(path)
    assert "model.safetensors" in os.listdir(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["vocab_size"] == 512
    assert sorted(os.listdir(tmp_path)) == sorted([TINY_FOLDER_NAME, f".{TINY_FOLDER_NAME}.lock"])


def test_lock_blocks_builder(tmp_path):
    """While another holder has the lock, a builder waits, then finds/does the work."""
    result: dict[str, object] = {}

    def run():
        try:
            result["path"] = tiny_model_path(str(tmp_path))
        except BaseException as e:  # pragma: no cover - reported below
            result["error"] = e

    with file_lock(os.path.join(str(tmp_path), f".{TINY_FOLDER_NAME}.lock")):
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(1.0)
        assert th.is_alive(), "builder did not wait for the lock"
        assert not os.path.exists(tmp_path / TINY_FOLDER_NAME)
    th.join(120)
    assert not th.is_alive()
    assert "error" not in result, result.get("error")
    assert is_materialized(str(result["path"]))


def test_concurrent_processes(tmp_path):
    """Two processes materializing at once: one builds, the other waits and reuses it."""
    code = (
        "import sys; from vllm_specplug.models.tiny import tiny_model_path; "
        "from vllm_specplug.models.reference import read_manifest; "
        "p = tiny_model_path(sys.argv[1]); print(p, read_manifest(p)['created_unix'])"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [out.strip() for out, _ in outs]
    assert lines[0] == lines[1]  # same folder, same build (same creation stamp)
    builds = sum(err.count("materialized tiny") for _, err in outs)
    assert builds == 1, [err for _, err in outs]
    assert is_materialized(os.path.join(str(tmp_path), TINY_FOLDER_NAME))


# --------------------------------------------------------------------------
# vLLM (default cache)
# --------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "x"]


@pytest.fixture(scope="module")
def tiny_path(tiny_model):  # session fixture from tests/conftest.py: tiny_model_path()
    return tiny_model


@pytest.fixture(scope="module")
def llm(tiny_path):
    from vllm import LLM

    engine = LLM(model=tiny_path, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield engine
    del engine
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _hf_greedy(path: str, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.mark.engine
def test_vllm_greedy(llm, tiny_path):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    for t in toks:
        assert len(t) == 32
        assert all(0 <= i < 512 for i in t)
        assert len(set(t)) >= 8, t  # not degenerate / constant
    assert len({tuple(t) for t in toks}) == len(toks)  # prompt-dependent
    # reproducible
    again = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert again == toks
    # same as transformers' greedy on the same folder
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    assert _hf_greedy(tiny_path, prompt_ids, 32) == toks


@pytest.mark.engine
def test_vllm_distribution_not_degenerate(llm, tiny_path):
    """Next-token distributions are spread out (good for sampling tests) and match HF."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=1, logprobs=20, seed=0)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    for o in outs:
        lp = o.outputs[0].logprobs[0]  # {token_id: Logprob}
        top = sorted(((v.logprob, k) for k, v in lp.items()), reverse=True)
        p1 = float(torch.tensor(top[0][0]).exp())
        assert 0.02 < p1 < 0.99, p1
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([o.prompt_token_ids])).logits[0, -1].float(), -1)
        for logprob, tok_id in top[:10]:
            assert abs(logprob - ref[tok_id].item()) < 1e-3


@pytest.mark.engine
def test_vllm_chat(llm):
    from vllm import SamplingParams

    out = llm.chat(
        [{"role": "user", "content": "Hello there"}],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    tok = llm.get_tokenizer()
    expected = tok.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    assert list(out[0].prompt_token_ids) == expected
    assert len(out[0].outputs[0].token_ids) == 16
    assert isinstance(out[0].outputs[0].text, str)
