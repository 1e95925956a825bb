"""`specplug serve` under bad requests and a failing method.

One server runs the ``oracle`` test method in noise mode with an injected
fault (``fail_on_token``: its ``propose`` raises whenever a request whose
prompt holds that token is in the batch); a plain server gives the
references. Checked: every bad request gets a clear 4xx while a concurrent
good request completes with plain decoding's output; the failing method never
takes the server down, the requests beside the poisoned one keep their
output, the poisoned one decodes plainly, the fault is logged once and
counted in ``specplug_stats`` and on ``/metrics``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from benchmarks.soak import Server, http_get, http_post, metric, parse_metrics

pytestmark = pytest.mark.engine

POISON = 7
MAX_LEN = 256


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    spec = {"method": "oracle", "num_speculative_tokens": 4, "mode": "noise",
            "fail_on_token": POISON}
    faulty = Server(tiny_model, spec, max_model_len=MAX_LEN,
                    log_path=str(logs / "oracle.log"))
    plain = Server(tiny_model, None, max_model_len=MAX_LEN, log_path=str(logs / "plain.log"))
    try:
        faulty.wait_ready()
        plain.wait_ready()
        yield faulty, plain
    finally:
        faulty.stop()
        plain.stop()


def _complete(server, prompt, max_tokens=24, **extra):
    return http_post(server.base + "/v1/completions", {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, **extra})


def _status(server, path, body) -> tuple[int, str]:
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _tokens(out) -> str:
    return out["choices"][0]["text"]


GOOD = [11, 12, 13, 11, 12, 13, 11, 12, 40, 41]


def test_bad_requests_get_4xx_while_a_good_one_completes(servers):
    faulty, plain = servers
    ref = _tokens(_complete(plain, GOOD, max_tokens=120))
    result = {}
    t = threading.Thread(target=lambda: result.update(
        out=_complete(faulty, GOOD, max_tokens=120)))
    t.start()
    m = faulty.model
    bad = {
        "empty prompt": {"model": m, "prompt": "", "max_tokens": 8},
        "empty token list": {"model": m, "prompt": [], "max_tokens": 8},
        "prompt longer than max_model_len": {"model": m, "prompt": [5] * (MAX_LEN + 10),
                                             "max_tokens": 8},
        "max_tokens beyond the context": {"model": m, "prompt": [5, 6, 7],
                                          "max_tokens": MAX_LEN + 100},
        "out-of-vocabulary token id": {"model": m, "prompt": [5, 6, 100_000],
                                       "max_tokens": 8},
        "negative token id": {"model": m, "prompt": [5, -3], "max_tokens": 8},
        "unknown sampling field": {"model": m, "prompt": [5, 6], "max_tokens": 8,
                                   "temprature": 0.5},
        "wrong type": {"model": m, "prompt": [5, 6], "max_tokens": "eight"},
    }
    answers = {}
    for name, body in bad.items():
        answers[name] = _status(faulty, "/v1/completions", body)
    chat = _status(faulty, "/v1/chat/completions", {
        "model": m, "messages": [{"role": "user", "content": "hi"}], "top_kk": 3})
    t.join(timeout=300)
    for name, (code, text) in answers.items():
        assert 400 <= code < 500, (name, code, text[:300])
        assert json.loads(text).get("error", {}).get("message"), (name, text[:300])
    assert answers["unknown sampling field"][0] == 400
    assert "'temprature'" in answers["unknown sampling field"][1]
    assert chat[0] == 400 and "'top_kk'" in chat[1]
    assert _tokens(result["out"]) == ref
    assert http_get(faulty.base + "/health") == ""


def test_failing_method_falls_back_without_hurting_others(servers):
    faulty, plain = servers
    prompts = [[POISON, 20, 21, 22, 20, 21, 22], [30, 31, 32, 30, 31, 32],
               [50, 51, 52, 53], GOOD]
    refs = [_tokens(_complete(plain, p, max_tokens=40)) for p in prompts]
    outs: list = [None] * len(prompts)

    def run(i):
        outs[i] = _tokens(_complete(faulty, prompts[i], max_tokens=40))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert outs == refs
    stats = faulty.specplug_stats()
    assert stats["propose_faults"] > 0 and stats["fault_requests"] >= stats["propose_faults"]
    assert stats["tree_drafts"] > 0  # the others kept their trees
    assert stats["live_trees"] == 0
    for _ in range(20):  # the front end reads the workers' counters once a second
        faults = metric(parse_metrics(http_get(faulty.base + "/metrics")),
                        "specplug:propose_faults_total", method="oracle")
        if faults > 0:
            break
        _complete(faulty, GOOD, max_tokens=4)
        time.sleep(1)
    assert faults > 0
    log = faulty.log_since_ready()
    assert log.count("specplug: method 'oracle' failed in propose") == 1, log[-3000:]
    assert "injected fault" in log
    assert http_get(faulty.base + "/health") == ""


def test_bad_specplug_request_fields_get_400_naming_the_field(servers):
    faulty, plain = servers
    m = faulty.model
    bad = {  # field -> vllm_xargs (the oracle server does not relax)
        "specplug_speculate": {"specplug_speculate": "maybe"},
        "specplug_bogus": {"specplug_bogus": 1},
        "_specplug_tenant": {"_specplug_tenant": "x"},
        "specplug_relaxed": {"specplug_relaxed": True},
    }
    for field, xargs in bad.items():
        code, text = _status(faulty, "/v1/completions", {
            "model": m, "prompt": [5, 6, 7], "max_tokens": 4, "vllm_xargs": xargs})
        assert code == 400, (field, code, text[:300])
        error = json.loads(text)["error"]
        assert error["param"] == field and field in error["message"], (field, error)
    code, text = _status(faulty, "/v1/chat/completions", {
        "model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "vllm_xargs": {"specplug_speculate": 2}})
    assert code == 400 and json.loads(text)["error"]["param"] == "specplug_speculate"
    ref = _tokens(_complete(plain, GOOD, max_tokens=24))
    for xargs in ({"specplug_speculate": False}, {"specplug_speculate": True,
                                                  "specplug_relaxed": False}):
        assert _tokens(_complete(faulty, GOOD, max_tokens=24, vllm_xargs=xargs)) == ref
    assert http_get(faulty.base + "/health") == ""
