"""Per-request speculative figures on a server running a specplug method:
vLLM's ``--per-request-spec-decode-metrics summary`` puts each request's
drafts (trees), draft tokens (tree nodes), accepted tokens (accepted depths)
and accepted-depth histogram in its response (``metrics.speculative_decoding``,
the last chunk of a stream). Their sums over the requests equal the
Prometheus counters (vLLM's ``vllm:spec_decode_*`` and the plugin's
``specplug:`` tree series) and the worker's own ``specplug_stats``: three
paths (the scheduler's per-request record, the front end's stat loggers,
the runner) that must agree."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from benchmarks.soak import Server, http_post, metric

pytestmark = pytest.mark.engine

PROMPTS = [
    "Repeat after me exactly, three times: the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 30, separated by commas.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "Write mul and div in the same style.",
    "List the days of the week, one per line, then list them again.",
    "Summarize: The cat sat on the mat. The cat was black. The mat was red. "
    "The cat sat on the mat all day, and the mat stayed red.",
    "Write the alphabet in capital letters, separated by spaces, twice.",
]
API = ("completions", "chat")


def _body(model: str, i: int, stream: bool, speculate: bool = True) -> tuple[str, dict]:
    api = API[i % 2]
    body = {"model": model, "max_tokens": 40, "temperature": 0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    else:
        body["prompt"] = PROMPTS[i % len(PROMPTS)]
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if not speculate:
        body["vllm_xargs"] = {"specplug_speculate": False}
    return f"/v1/{'chat/' if api == 'chat' else ''}completions", body


def _streamed(url: str, body: dict) -> dict:
    """The metrics of a stream (they ride on its final usage chunk)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    found = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("metrics"):
                    found = chunk["metrics"]
    return found


def _request(server: Server, i: int, speculate: bool = True) -> dict | None:
    stream = i % 3 == 2
    path, body = _body(server.model, i, stream, speculate)
    if stream:
        metrics = _streamed(server.base + path, body)
    else:
        metrics = http_post(server.base + path, body, timeout=300).get("metrics")
    return (metrics or {}).get("speculative_decoding")


def _series(m: dict) -> dict[str, float]:
    return {
        "drafts": m.get("vllm:spec_decode_num_drafts_total", 0.0),
        "draft_tokens": m.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
        "accepted": m.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
        "trees": m.get("specplug:trees_total", 0.0),
        "tree_nodes": m.get("specplug:tree_nodes_total", 0.0),
        "depth_total": m.get("specplug:accepted_depth_total", 0.0),
        **{f"depth={k}": metric(m, "specplug:accepted_depth_drafts_total", depth=str(k))
           for k in range(9)},
    }


def _sums(per_request: list[dict]) -> dict[str, float]:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    hist = [0] * 9
    for r in per_request:
        out["drafts"] += r["num_spec_steps"]
        out["draft_tokens"] += r["num_draft_tokens"]
        out["accepted"] += r["num_accepted_draft_tokens"]
        for k, n in enumerate(r["acceptance_histogram"]):
            hist[k] += n
    return {**out, "trees": out["drafts"], "tree_nodes": out["draft_tokens"],
            "depth_total": out["accepted"], **{f"depth={k}": hist[k] for k in range(9)}}


def _worker(stats: dict) -> dict[str, int]:
    return {"drafts": stats["drafts"], "draft_tokens": stats["draft_tokens"],
            "accepted": stats["accepted_tokens"]}


def test_per_request_figures_add_up_to_the_counters(ref_model, tmp_path):
    # A pinned tree size: this checks the counting paths, not whether drafting pays
    # on this machine under this load (the cost-aware budget may draft almost nothing).
    spec = {"method": "pld", "num_speculative_tokens": 8, "cost_aware": False}
    server = Server(ref_model, spec, max_model_len=1024, log_path=str(tmp_path / "s.log"),
                    extra_args=("--per-request-spec-decode-metrics", "summary",
                                "--max-num-seqs", "16"))
    with server:
        before, stats0 = _series(server.metrics()), server.specplug_stats()
        results: dict[int, dict | None] = {}

        def run(i):
            results[i] = _request(server, i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        opted_out = _request(server, 0, speculate=False)
        per_request = [results[i] for i in range(9)]
        assert all(r is not None for r in per_request), results
        expected = _sums(per_request + [opted_out])
        deadline = time.time() + 30  # the last step's stats reach the loggers after it
        while True:
            raw = server.metrics()
            after = _series(raw)
            delta = {k: after[k] - before[k] for k in after}
            if delta == expected or time.time() > deadline:
                break
            time.sleep(0.5)
        stats1 = server.specplug_stats()
    assert opted_out["num_spec_steps"] == 0 and opted_out["num_draft_tokens"] == 0
    assert expected["drafts"] > 0 and expected["accepted"] > 0  # it drafted, it accepted
    assert all(len(r["acceptance_histogram"]) == 9 for r in per_request)  # k = 8
    for r in per_request:
        steps = r["num_spec_steps"]
        assert steps == sum(r["acceptance_histogram"])
        if steps:
            assert r["mean_acceptance_length"] == pytest.approx(
                1 + r["num_accepted_draft_tokens"] / steps)
    assert delta == expected, (delta, expected)
    # the tree series carry the method's name
    assert metric(raw, "specplug:trees_total", method="pld") == after["trees"] > 0, raw
    worker = {k: _worker(stats1)[k] - _worker(stats0)[k] for k in ("drafts", "draft_tokens",
                                                                   "accepted")}
    assert worker == {k: expected[k] for k in worker}
