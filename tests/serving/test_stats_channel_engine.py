"""The runner's counters reach /metrics on vLLM's own stats path, on real
engines: no file in the temporary folder is written or read.

- A server with two API server processes (Prometheus multiprocess mode; vLLM
  hands each step's stats to one of them) and a method that faults on one
  token: /metrics equals the worker's own ``specplug_stats`` (no increment
  lost, none counted twice), while files named like the old per-rank stats
  files (a named pipe, a non-numeric counter) sit in the temporary folder,
  and no new such file appears.
- Tensor parallelism (2 ranks): /metrics shows the output rank's counters,
  rank 0, whose trees every rank verifies.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from benchmarks.soak import Server, http_get, http_post, metric, parse_metrics

pytestmark = pytest.mark.engine

POISON = 7
COMPARED = ("propose_faults", "fault_requests", "steps", "drafts")
OLD_FILES = os.path.join(tempfile.gettempdir(), "specplug-stats-*")


@pytest.fixture
def planted():
    """A named pipe (an ``open`` of it blocks) and a file with a non-numeric
    counter, named as the per-rank stats files used to be."""
    tmp = tempfile.gettempdir()
    tag = f"{os.getpid()}-planted"
    pipe = os.path.join(tmp, f"specplug-stats-{tag}-rank0.json")
    bad = os.path.join(tmp, f"specplug-stats-{tag}-rank1.json")
    os.mkfifo(pipe)
    with open(bad, "w") as f:
        json.dump({"propose_faults": "many", "fault_requests": None, "pid": "x"}, f)
    try:
        yield {pipe, bad}
    finally:
        for path in (pipe, bad):
            os.remove(path)


def _complete(server: Server, prompt: list[int]) -> str:
    out = http_post(server.base + "/v1/completions", {
        "model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
        "ignore_eos": True})
    return out["choices"][0]["text"]


@pytest.mark.slow  # ~4 min; the unit tests in test_fault_metrics.py cover every leg
def test_two_api_servers_export_exact_counters_without_files(tiny_model, planted,
                                                             tmp_path):
    before = set(glob.glob(OLD_FILES))
    spec = {"method": "oracle", "num_speculative_tokens": 4, "mode": "noise",
            "fail_on_token": POISON}
    server = Server(tiny_model, spec, max_model_len=256, log_path=str(tmp_path / "s.log"),
                    extra_args=("--api-server-count", "2"))
    try:
        server.wait_ready()
        prompts = [[POISON, 20, 21, 22, 20, 21, 22], [30, 31, 32, 30, 31, 32],
                   [50, 51, 52, 53], [POISON, 40, 41, 40, 41]]
        outs: list = [None] * len(prompts)

        def run(i):
            outs[i] = _complete(server, prompts[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert all(isinstance(o, str) for o in outs)
        stats = server.specplug_stats()
        assert stats["propose_faults"] > 0 and stats["steps"] > 0
        want = {k: float(stats[k]) for k in COMPARED}
        for _ in range(30):  # the last step's stats may still be on their way
            got = {k: metric(parse_metrics(http_get(server.base + "/metrics")),
                             f"specplug:{k}_total", method="oracle") for k in COMPARED}
            if got == want:
                break
            time.sleep(1)
        assert got == want
        assert http_get(server.base + "/health") == ""
        assert _complete(server, [60, 61, 62])  # still serving
        assert "specplug-stats" not in server.log_since_ready()
    finally:
        server.stop()
    assert set(glob.glob(OLD_FILES)) == before  # only the planted ones


TP_SCRIPT = textwrap.dedent("""
    import json, sys
    from prometheus_client import REGISTRY
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_specplug.metrics import SpecplugStatLogger
    if __name__ == "__main__":
        model, spec, prompts, names = json.loads(sys.argv[1])
        load_general_plugins()
        args = EngineArgs(model, tensor_parallel_size=2, dtype="float32", max_model_len=512,
                          enforce_eager=True, seed=0, speculative_config=spec,
                          disable_log_stats=False)
        engine = LLMEngine.from_engine_args(args, stat_loggers=[SpecplugStatLogger])
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
        metrics = {n: REGISTRY.get_sample_value(f"specplug:{n}_total", {"method": "oracle"})
                   for n in names}
        print("RESULT " + json.dumps({"metrics": metrics,
                                      "stats": engine.collective_rpc("specplug_stats")}))
""")


@pytest.mark.slow  # ~4 min: a second TP=2 engine beside test_tensor_parallel.py's
def test_tp2_metrics_show_the_output_rank(tiny_model, tmp_path):
    script = tmp_path / "tp2_metrics.py"
    script.write_text(TP_SCRIPT)
    spec = {"method": "oracle", "num_speculative_tokens": 4, "mode": "noise",
            "fail_on_token": POISON}
    prompts = [[POISON, 20, 21, 22, 20, 21], [30, 31, 32, 30, 31, 32]]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    out = subprocess.run([sys.executable, str(script),
                          json.dumps([tiny_model, spec, prompts, list(COMPARED)])],
                         env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    rank0 = res["stats"][0]
    assert len(res["stats"]) == 2 and rank0["propose_faults"] > 0
    assert res["metrics"] == {k: float(rank0[k]) for k in COMPARED}
