"""`specplug selftest`: its statistics against scipy, and (slow) a full run
on the tiny model."""

from __future__ import annotations

import json
import random

import pytest
from scipy.stats import chi2_contingency

from vllm_specplug.selftest import homogeneity_pvalue


@pytest.mark.parametrize("shift", [0.0, 0.15])
def test_homogeneity_pvalue_matches_scipy(shift):
    rng = random.Random(0)
    a = [min(int(rng.expovariate(0.3)), 20) for _ in range(2000)]
    b = [min(int(rng.expovariate(0.3 + shift)), 20) for _ in range(1500)]
    keys = sorted(k for k in set(a) | set(b) if a.count(k) + b.count(k) >= 10)
    rest = [sum(1 for x in s if x not in keys) for s in (a, b)]
    table = [[a.count(k) for k in keys] + [rest[0]], [b.count(k) for k in keys] + [rest[1]]]
    table = [[r[j] for j in range(len(r)) if table[0][j] + table[1][j]] for r in table]
    want = chi2_contingency(table, correction=False).pvalue
    assert homogeneity_pvalue(a, b) == pytest.approx(want, rel=1e-6, abs=1e-12)


@pytest.mark.slow
@pytest.mark.engine
def test_selftest_on_tiny_model(tiny_model, capsys):
    """The real engines: the oracle control passes with trees verified and
    nodes moved, recycle with trees verified; pld finds no n-gram of the
    random model's output in its prompts, drafts nothing, and so cannot
    pass."""
    from vllm_specplug.cli import main

    rc = main(["selftest", "--model", tiny_model, "--methods", "recycle", "pld",
               "--samples", "300", "--max-tokens", "24"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if " greedy " in line}
    assert " PASS " in rows["oracle"] and " PASS " in rows["recycle"], out
    assert " FAIL " in rows["pld"] and "proves nothing" in rows["pld"], out
    assert any("sampling T=1" in line and " PASS " in line for line in out.splitlines()), out
    assert "CPUAttentionBackendImpl" in out and rc == 1


# ------------------------------------------------------------------ the verdicts, with fakes

from types import SimpleNamespace  # noqa: E402

from vllm_specplug import selftest  # noqa: E402
from vllm_specplug.selftest import RunPlan, greedy_verdict, plan_runs, skip_reason  # noqa: E402

F32 = RunPlan("float32", "TRITON_ATTN", True)
BF16 = RunPlan("bfloat16", "FLASH_ATTN", False)


def test_runs_per_device():
    assert plan_runs(None, None, "cpu") == [RunPlan("float32", None, True)]
    assert plan_runs(None, None, "cuda") == [F32, BF16]
    assert plan_runs("bfloat16", "FLASH_ATTN", "cuda") == [BF16]
    assert plan_runs(None, "TRITON_ATTN", "cuda") == [F32]


def _plain(outs, margin=1.0):
    return (outs, [[margin] * len(o) for o in outs])


@pytest.mark.parametrize("plan,got,margin,stats,status,words", [
    (F32, [[1, 2, 3]], 1.0, (2, 3), "PASS", "3 tokens identical; 2 trees verified, 3 nodes moved"),
    (F32, [[1, 2, 3]], 1.0, (0, 0), "FAIL", "nothing was exercised"),
    (F32, [[1, 2, 3]], 1.0, (4, 0), "PASS", "4 trees verified, 0 nodes moved (every accepted"),
    (F32, [[1, 9, 3]], 1e-6, (2, 3), "FAIL",
     "request 0 differs from token 1 (plain logit margin 1e-06)"),
    (BF16, [[1, 9, 3]], 0.01, (2, 3), "PASS",
     "near-ties: batch 1: request 0 differs from token 1 (plain logit margin 0.01, a near-tie)"),
    (BF16, [[1, 9, 3]], 2.0, (2, 3), "FAIL", "differs from token 1 (plain logit margin 2)"),
    (F32, [[1, 2]], 1.0, (2, 3), "FAIL", "differs from token 2"),
])
def test_greedy_verdict(plan, got, margin, stats, status, words):
    plain = {1: _plain([[1, 2, 3]], margin)}
    got_status, detail = greedy_verdict({1: got}, plain,
                                        {"tree_drafts": stats[0], "kv_moves": stats[1]}, plan)
    assert got_status == status and words in detail, detail


def test_top2_margin():
    assert selftest.top2_margin({5: -0.1, 7: -2.1}) == pytest.approx(2.0)
    assert selftest.top2_margin({5: -0.1}) is None


def _other_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 99}))
    return str(tmp_path)


def _hide(monkeypatch, *packages):
    real = selftest.importlib.util.find_spec
    monkeypatch.setattr(selftest.importlib.util, "find_spec",
                        lambda name, *a: None if name in packages else real(name, *a))


def test_skip_reasons(tmp_path, monkeypatch):
    from vllm_specplug import registry

    model = _other_model(tmp_path)
    _hide(monkeypatch, "arctic_inference")
    assert "arctic-inference==0.3.0" in skip_reason(
        "suffix_tree", registry.get("suffix_tree").config_cls, {}, model)
    for name in ("eagle3_tree", "respec", "reader", "graft"):
        why = skip_reason(name, registry.get(name).config_cls, {}, model)
        assert "no EAGLE-3 head ships for this model" in why
        assert skip_reason(name, registry.get(name).config_cls, {"head": "/h"}, model) is None
    assert "datastore" in skip_reason("dresd", registry.get("dresd").config_cls, {}, model)
    assert skip_reason("pld", registry.get("pld").config_cls, {}, model) is None


class FakeEngine:
    """A stand-in for one vLLM engine: plain decoding emits fixed tokens; a
    method's behaviour (``world[method]``) sets its trees, moves and errors."""

    BACKENDS = {"TRITON_ATTN": "TritonAttentionImpl", "FLASH_ATTN": "FlashAttentionImpl",
                None: "CPUAttentionBackendImpl"}

    def __init__(self, world, spec, plan):
        self.spec, self.plan = spec, plan
        self.do = world.get(spec["method"] if spec else None, {})
        self.drafts = self.moves = 0
        world.setdefault("specs", []).append(spec)

    def info(self):
        return {"backend": self.BACKENDS[self.plan.backend], "graph_mode": "PIECEWISE",
                "device": "FakeGPU", "dtype": self.plan.dtype}

    def stats(self):
        return {"tree_drafts": self.drafts, "kv_moves": self.moves,
                "mean_accepted_length": 1.5}

    def greedy(self, prompts, max_tokens, logprobs=False):
        outs = [[100 + i + t for t in range(max_tokens)] for i in range(len(prompts))]
        r, pos = self.do.get("diverge_at", (None, None))
        if r is not None and r < len(outs) and self.plan.dtype in self.do.get(
                "dtypes", ("float32", "bfloat16")):
            outs[r][pos] += 1
        self.drafts += self.do.get("drafts", 3)
        self.moves += self.do.get("moves", 2)
        margins = [[self.do.get("margin", 1.0)] * max_tokens for _ in outs]
        return [[1, 2]] * len(prompts), outs, margins if logprobs else None

    def sample(self, prompt, n):
        self.drafts += self.do.get("drafts", 3)
        return [[1, 2]] * n, [[0, t % 5, t % 3] for t in range(n)]


def _run(tmp_path, monkeypatch, world, methods, device="cuda"):
    import contextlib

    @contextlib.contextmanager
    def engine(model, spec, args, plan):
        if spec is not None and world.get(spec["method"], {}).get("crash"):
            raise RuntimeError("engine core died")
        yield FakeEngine(world, spec, plan)

    args = SimpleNamespace(model=_other_model(tmp_path), methods=methods, options="{}",
                           dtype=None, attention_backend=None, max_tokens=6,
                           num_speculative_tokens=8, enforce_eager=None, samples=60)
    _hide(monkeypatch, "arctic_inference")
    return selftest.run(args, engine=engine, device_type=device)


def test_run_passes_skips_and_shows_each_engine(tmp_path, monkeypatch, capsys):
    world = {"pld": {}, None: {"margin": 0.01}}
    rc = _run(tmp_path, monkeypatch, world, ["pld", "suffix_tree", "eagle3_tree"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for plan in ("float32/TRITON_ATTN", "bfloat16/FLASH_ATTN"):
        for engine in ("baseline (vLLM alone)", "pld", "oracle"):
            assert f"{engine} {plan}" in out
    assert "TritonAttentionImpl" in out and "FlashAttentionImpl" in out
    lines = [x for x in out.splitlines() if x.startswith(("oracle ", "pld ", "suffix_tree ",
                                                          "eagle3_tree "))]
    results = [x.split()[3] for x in lines if "greedy" in x]
    assert results.count("PASS") == 4 and results.count("SKIP") == 4, out
    assert "0 failed, 4 skipped" in out
    methods = [s for s in world["specs"] if s is not None]
    assert all(s["cost_aware"] is False for s in methods if s.get("mode") != "trie")
    oracle = next(s for s in methods if s["method"] == "oracle")
    assert oracle["shuffle"] is True and oracle["mode"] == "random"


@pytest.mark.parametrize("method,behaviour,words", [
    ("pld", {"diverge_at": (3, 4), "dtypes": ("float32",)},
     "batch 8: request 3 differs from token 4"),
    ("pld", {"drafts": 0, "moves": 0}, "nothing was exercised"),
    ("oracle", {"moves": 0}, "nothing was exercised"),
    ("pld", {"crash": True}, "RuntimeError: engine core died"),
])
def test_run_fails(tmp_path, monkeypatch, capsys, method, behaviour, words):
    rc = _run(tmp_path, monkeypatch, {method: behaviour}, ["pld"])
    out = capsys.readouterr().out
    assert rc == 1 and words in out and "FAILED" in out, out


def test_bf16_divergence_away_from_a_tie_fails(tmp_path, monkeypatch, capsys):
    world = {"pld": {"diverge_at": (0, 2), "dtypes": ("bfloat16",)}, None: {"margin": 3.0}}
    rc = _run(tmp_path, monkeypatch, world, ["pld"])
    out = capsys.readouterr().out
    assert rc == 1, out
    fail = [x for x in out.splitlines() if x.startswith("pld ") and "FAIL" in x]
    assert len(fail) == 1 and "bfloat16/FLASH_ATTN" in fail[0]
    assert "plain logit margin 3)" in fail[0]


def test_a_method_that_never_drafts_checks_equality_only():
    plain = {1: _plain([[1, 2, 3]])}
    none = {"tree_drafts": 0, "kv_moves": 0}
    status, detail = greedy_verdict({1: [[1, 2, 3]]}, plain, none, F32, require="none")
    assert status == "PASS" and "no speculation" in detail
    assert greedy_verdict({1: [[1, 5, 3]]}, plain, none, F32, require="none")[0] == "FAIL"


def test_the_oracle_control_must_move_nodes():
    plain = {1: _plain([[1, 2, 3]])}
    trees_only = {"tree_drafts": 4, "kv_moves": 0}
    status, detail = greedy_verdict({1: [[1, 2, 3]]}, plain, trees_only, F32, require="moves")
    assert status == "FAIL" and "0 nodes moved" in detail
    assert "plain" in selftest.DRAFTS_NOTHING
