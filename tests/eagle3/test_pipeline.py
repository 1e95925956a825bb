"""EAGLE-3 heads: data -> training -> vLLM's own eagle3 path, on the tiny model.

Unit tests (no engine): the training-time-test unroll equals one-position-at-
a-time drafting; checkpoint round trip and vocabulary mapping.
Engine tests: a short data generation (vLLM) + training run lowers the loss;
the saved head loads in vLLM's built-in ``eagle3`` path with greedy output
identical to no speculation (batch 1 and 8), and vLLM's first drafts equal
what the torch head proposes from the target's (transformers) features.
Every engine runs in its own spawned process.
"""

from __future__ import annotations

import json
import os

import pytest

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
K_SPEC = 3


def _isolated(func, *args):
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(func, args)


def _tiny():
    from vllm_specplug.models.tiny import tiny_model_path

    return tiny_model_path()


def _random_head(vd: int = 512, seed: int = 0):
    import torch

    from vllm_specplug.eagle3.model import Eagle3Draft, build_head_config, vocab_mapping

    with open(os.path.join(_tiny(), "config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    torch.manual_seed(seed)
    cfg = build_head_config(tc, (0, 1, 2), vd)
    used = sorted(torch.randperm(512)[:vd].tolist()) if vd < 512 else list(range(512))
    d2t, t2d = vocab_mapping(used, 512)
    m = Eagle3Draft(cfg, torch.randn(512, 256), d2t if vd < 512 else None,
                    t2d if vd < 512 else None)
    m.reset_parameters(0.1)
    return m


# --------------------------------------------------------------------------
# unit tests
# --------------------------------------------------------------------------


def test_default_aux_layers():
    from vllm_specplug.eagle3.model import default_aux_layers

    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's rule
    assert default_aux_layers(2) == (0, 1, 2)  # tiny: evenly spaced fallback


@pytest.mark.parametrize("vd", [512, 200])
def test_unroll_matches_incremental_drafting(vd):
    import torch

    torch.set_num_threads(1)
    m = _random_head(vd)
    t_len, steps, row_start = 40, 4, 9
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (t_len,), generator=g)
    aux = torch.randn(t_len, 768, generator=g)
    outs = m.unroll(tokens, aux, steps, row_start)
    assert [o.shape[0] for o in outs] == [t_len - 2 - row_start] * steps
    for i in (9, 14, 30, 37):
        forced = (tokens[i + 2:i + 1 + steps].tolist() + [0] * steps)[:steps - 1]
        _, chain = m.chain(tokens[:i + 1], aux[:i + 1], int(tokens[i + 1]), steps, forced=forced)
        for k in range(steps):
            torch.testing.assert_close(outs[k][i - row_start], chain[k], atol=2e-4, rtol=1e-4)


def test_save_load_roundtrip(tmp_path):
    import torch
    from safetensors import safe_open

    from vllm_specplug.eagle3.model import load_head, save_head

    m = _random_head(200)
    save_head(m, str(tmp_path), dtype="float32")
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 200 and cfg["vocab_size"] == 512
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        d2t = f.get_tensor("d2t")
    assert "embed_tokens" not in " ".join(keys)  # shared with the target by vLLM
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} <= keys
    assert d2t.dtype == torch.int64
    target_ids = torch.arange(200) + d2t
    assert torch.equal(m.t2d.nonzero().squeeze(-1), target_ids)
    m2 = load_head(str(tmp_path), m.embed)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)


# --------------------------------------------------------------------------
# engine tests (the pipeline on the tiny model)
# --------------------------------------------------------------------------


def _gen_data(target: str, out: str) -> dict:
    os.environ.update(ENV)
    import torch

    torch.set_num_threads(1)
    from vllm_specplug.eagle3.data import generate_data

    # 24 short prompts, some 2-turn: conversation, code, math
    return generate_data(target, out, sources="synthetic:16,humaneval:4,gsm8k:4",
                         max_new_tokens=40, max_prompt_tokens=400, shard_size=12, threads=1)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    from vllm_specplug.eagle3.train import TrainConfig, train

    base = tmp_path_factory.mktemp("eagle3")
    target = _tiny()
    data, head = str(base / "data"), str(base / "head")
    man = _isolated(_gen_data, target, data)
    # resumable: a second run only re-reads what exists
    res = train(data, head, TrainConfig(
        draft_vocab_size=300, ttt_steps=4, max_updates=24, batch_size=4, lr=3e-3, warmup=2,
        eval_samples=4, save_every=12, log_every=4, threads=1, progress=False))
    return {"target": target, "data": data, "head": head, "manifest": man, "result": res}


@pytest.mark.engine
def test_data_and_training(pipeline):
    from safetensors import safe_open

    man = pipeline["manifest"]
    assert man["num_samples"] >= 24  # 2-turn prompts add samples
    assert man["aux_layers"] == [0, 1, 2]
    assert len(man["shards"]) == 2
    with safe_open(os.path.join(pipeline["data"], "shard_00000.safetensors"), "pt") as f:
        assert f.get_slice("aux").get_shape()[1] == 3 * 256
        assert f.get_slice("aux").get_dtype() == "F16"
        assert f.get_slice("input_ids").get_shape()[0] == f.get_slice("aux").get_shape()[0]
    hist = pipeline["result"]["history"]
    train_loss = [h["loss"] for h in hist["train"]]
    assert train_loss[-1] < 0.8 * train_loss[0], train_loss
    ev = [h["loss"] for h in hist["eval"]]
    assert ev[-1] < ev[0], ev
    head = pipeline["head"]
    for name in ("config.json", "model.safetensors", "curves.json", "curves.png",
                 "specplug_eagle3.json", "checkpoint/state.pt"):
        assert os.path.exists(os.path.join(head, name)), name
    with open(os.path.join(head, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["draft_vocab_size"] == 300 and cfg["torch_dtype"] == "float16"


@pytest.mark.engine
def test_resume_is_a_no_op_when_done(pipeline):
    from vllm_specplug.eagle3.data import generate_data
    from vllm_specplug.eagle3.train import TrainConfig, train

    # everything exists: no engine is started, nothing is recomputed
    man = generate_data(pipeline["target"], pipeline["data"],
                        sources="synthetic:16,humaneval:4,gsm8k:4", max_new_tokens=40,
                        max_prompt_tokens=400, shard_size=12)
    assert man["num_samples"] == pipeline["manifest"]["num_samples"]
    assert man["seconds_last_run"]["generate"] < 1.0
    res = train(pipeline["data"], pipeline["head"], TrainConfig(
        draft_vocab_size=300, ttt_steps=4, max_updates=24, batch_size=4, eval_samples=4,
        threads=1, progress=False))
    assert res["update"] == 24


@pytest.mark.engine
def test_init_from_continues_a_saved_head(pipeline, tmp_path):
    """--init-from starts where a saved head is (same eval loss, same draft
    vocabulary), not from scratch, and records where it came from."""
    from vllm_specplug.eagle3.train import TrainConfig, train

    with open(os.path.join(pipeline["head"], "specplug_eagle3.json"), encoding="utf-8") as f:
        before = json.load(f)
    out = str(tmp_path / "more")
    res = train(pipeline["data"], out, TrainConfig(
        init_from=pipeline["head"], ttt_steps=4, max_updates=4, batch_size=4, lr=1e-3,
        warmup=1, eval_samples=4, save_every=100, log_every=2, threads=1, progress=False))
    start = res["history"]["eval"][0]
    assert start["loss"] == pytest.approx(before["eval"]["loss"], rel=0.02)
    # a from-scratch head starts far higher
    assert start["loss"] < pipeline["result"]["history"]["eval"][0]["loss"]
    with open(os.path.join(out, "specplug_eagle3.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["train"]["draft_vocab_size"] == 300
    assert meta["train"]["init_from"]["path"] == os.path.abspath(pipeline["head"])
    assert meta["train"]["init_from"]["train"]["updates"] == before["train"]["updates"]


def test_init_from_rejects_a_head_of_another_shape():
    from vllm_specplug.eagle3.train import _check_init_head

    cfg = {"vocab_size": 512, "target_hidden_size": 256,
           "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    tcfg = {"vocab_size": 512, "hidden_size": 256}
    _check_init_head(cfg, tcfg, (0, 1, 2), "h")
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        _check_init_head(cfg, tcfg, (0, 1, 3), "h")
    with pytest.raises(ValueError, match="vocab_size 512 \\(target/data: 1000\\)"):
        _check_init_head(cfg, {"vocab_size": 1000, "hidden_size": 256}, (0, 1, 2), "h")


def _run_engines(target: str, head: str, prompts: list[list[int]], max_tokens: int,
                 k: int = K_SPEC) -> dict:
    """Baseline and eagle3 engines in this (spawned) process; records vLLM's
    drafter calls."""
    os.environ.update(ENV)
    import gc

    import torch

    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.spec_decode import llm_base_proposer as lbp

    calls: list[dict] = []
    orig = lbp.SpecDecodeBaseProposer.propose

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, *args, **kwargs):
        out = orig(self, num_speculative_tokens, target_token_ids, target_positions,
                   target_hidden_states, next_token_ids, *args, **kwargs)
        calls.append({"tokens": target_token_ids.tolist(),
                      "positions": target_positions.tolist(),
                      "next": next_token_ids.tolist(), "drafts": out.tolist()})
        return out

    lbp.SpecDecodeBaseProposer.propose = propose
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(spec):
        llm = LLM(model=target, speculative_config=spec, dtype="float32", enforce_eager=True,
                  max_model_len=1024, seed=0, disable_log_stats=False,
                  enable_prefix_caching=False)
        try:
            res = {}
            for name, batch in (("b1", prompts[:1]), ("b8", prompts[:8])):
                calls.clear()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                                    use_tqdm=False)
                res[name] = [list(o.outputs[0].token_ids) for o in outs]
                res[name + "_calls"] = list(calls)
            firsts = []
            for p in prompts[:4]:  # batch 1: the first call is the prefill's
                calls.clear()
                llm.generate([TokensPrompt(prompt_token_ids=p)],
                             SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                             use_tqdm=False)
                if calls:
                    firsts.append(calls[0])
            res["first_calls"] = firsts
            counters: dict = {}
            for m in llm.get_metrics():
                if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
                    counters[m.name.removeprefix("vllm:spec_decode_num_")] = m.value
            res["counters"] = counters
            return res
        finally:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None:
                core.shutdown()
            del llm
            gc.collect()

    base = run(None)
    spec = run({"method": "eagle3", "model": head, "num_speculative_tokens": k})
    return {"base": base, "spec": spec}


@pytest.fixture(scope="module")
def engines(pipeline):
    import random

    rng = random.Random(0)
    # prompts the head was trained on the distribution of: chat-rendered text
    with open(os.path.join(pipeline["data"], "gen", "chunk_00000.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    prompts = [s["prompt_ids"] for s in samples[:6]]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))] for _ in range(2)]
    out = _isolated(_run_engines, pipeline["target"], pipeline["head"], prompts, 24)
    out["prompts"] = prompts
    return out


@pytest.mark.engine
def test_head_loads_in_vllm_eagle3_greedy_equal(engines):
    base, spec = engines["base"], engines["spec"]
    assert spec["b1"] == base["b1"]
    assert spec["b8"] == base["b8"]
    assert len(spec["b8"]) == 8 and all(len(o) == 24 for o in spec["b8"])
    assert spec["counters"].get("drafts", 0) > 0
    assert spec["counters"].get("draft_tokens", 0) == K_SPEC * spec["counters"]["drafts"]


@pytest.mark.engine
def test_vllm_drafts_equal_torch_head(engines, pipeline):
    """vLLM's first drafts after each prefill == the torch head's, from the
    transformers features: the aux layers, the fc fusion, the positions, the
    draft-vocab mapping and the multi-step attention all agree."""
    import torch

    from vllm_specplug.eagle3.data import _AuxCapture
    from vllm_specplug.eagle3.model import load_head
    from vllm_specplug.eagle3.train import load_target_weights

    torch.set_num_threads(1)
    head = load_head(pipeline["head"], load_target_weights(pipeline["target"])["embed"])
    # the saved (fp16) weights are what vLLM runs
    cap = _AuxCapture(pipeline["target"], (0, 1, 2))
    firsts = engines["spec"]["first_calls"]
    assert len(firsts) == 4
    agree = total = 0
    for call, prompt in zip(firsts, engines["prompts"]):
        assert call["tokens"] == prompt and call["positions"] == list(range(len(prompt)))
        with torch.inference_mode():
            aux = cap(torch.tensor([prompt]))[0][0]
        drafts = head.propose(torch.tensor(prompt), aux, call["next"][0], K_SPEC)
        agree += sum(int(a == b) for a, b in zip(drafts, call["drafts"][0]))
        total += K_SPEC
        assert drafts[0] == call["drafts"][0][0], (drafts, call["drafts"])
    assert agree >= total - 1, (agree, total)
