"""Memory caps of the EAGLE-3 head's per-request state: K/V per request
(``max_request_tokens``) and for all requests (``max_kv_bytes``), the
prefix store's bound, and the held rows of all gated requests
(``max_total_held_mib``). A request past a cap stops drafting with the head
(its K/V freed); the others draft as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.engine.interface import ProposerContext, StepRequest

ROW = 2 * 3 * 64 * 4  # K and V of one position: 3 KV heads x 64 dims, float32
AUX = 3 * 576  # the reference model's three aux layers
HELD_ROW = AUX * 4


@pytest.fixture(scope="module")
def head():
    from vllm_specplug.eagle3 import shipped_head_path
    from vllm_specplug.eagle3.model import load_head

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(49152, 576, generator=g) * 0.05
    return load_head(shipped_head_path(), embed).eval()


def _runtime(head, **kw):
    from vllm_specplug.eagle3.runtime import Eagle3Runtime

    return Eagle3Runtime(head, **kw)


def _rows(n: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 49152, (n + 1,), generator=g).numpy()
    return toks, torch.randn(n, AUX, generator=g) * 0.1


def _extend(rt, rid, toks, aux, pos, n):
    rt.extend([(rid, pos, toks[:pos + n + 1], aux[pos:pos + n])])


def _drafts(rt, rid, n_tokens) -> bool:
    return rt.ready(rid, n_tokens) and rt.draft([rid], [8], depth=3, topk=2)[0] is not None


def test_a_request_past_its_own_cap_stops_drafting_and_frees_its_kv(head):
    rt = _runtime(head, store_tokens=0, max_request_tokens=100)
    toks, aux = _rows(120, 1)
    other, other_aux = _rows(50, 2)
    rt.add("a")
    rt.add("b")
    assert rt.states["a"].k.shape[0] == 100  # never allocated past the cap
    _extend(rt, "a", toks, aux, 0, 64)
    _extend(rt, "b", other, other_aux, 0, 50)
    assert _drafts(rt, "a", 65) and _drafts(rt, "b", 51)
    _extend(rt, "a", toks, aux, 64, 30)  # 94 positions: still within
    assert rt.states["a"].k.shape[0] == 100 and _drafts(rt, "a", 95)
    _extend(rt, "a", toks, aux, 94, 20)  # 114: past it
    assert not rt.ready("a", 115) and rt.draft(["a"], [8])[0] is None
    assert rt.stats.kv_capped == 1
    assert rt.kv_bytes == 100 * ROW  # only b's state is left
    _extend(rt, "a", toks, aux, 114, 1)  # no more rows reach a capped state
    assert rt.kv_bytes == 100 * ROW and rt.stats.kv_capped == 1
    assert _drafts(rt, "b", 51)
    rt.remove("a")
    rt.remove("b")
    assert rt.kv_bytes == 0


def test_all_states_together_stay_under_max_kv_bytes(head):
    cap = 600 * ROW
    rt = _runtime(head, store_tokens=0, max_kv_bytes=cap)
    toks, aux = _rows(320, 3)
    for rid in "abc":
        rt.add(rid)
    # two initial states of 256 positions fit, a third would not: it starts empty
    assert [rt.states[r].k.shape[0] for r in "abc"] == [256, 256, 0]
    _extend(rt, "c", toks, aux, 0, 40)  # grows by only what its rows need
    assert rt.states["c"].k.shape[0] == 40 and _drafts(rt, "c", 41)
    _extend(rt, "a", toks, aux, 0, 300)  # doubling would pass: only 300
    assert rt.states["a"].k.shape[0] == 300 and rt.kv_bytes == 596 * ROW
    _extend(rt, "a", toks, aux, 300, 10)  # 310 positions: no room left
    assert rt.stats.kv_capped == 1 and not rt.ready("a", 311)
    assert rt.kv_bytes == 296 * ROW <= cap
    _extend(rt, "b", toks, aux, 0, 200)  # within its 256
    assert _drafts(rt, "b", 201) and _drafts(rt, "c", 41)


def test_drafts_below_the_caps_are_the_uncapped_drafts(head):
    toks, aux = _rows(90, 4)
    trees = []
    for kw in ({}, {"max_request_tokens": 95, "max_kv_bytes": 95 * ROW}):
        rt = _runtime(head, store_tokens=0, **kw)
        _extend(rt, "a", toks, aux, 0, 60)
        _extend(rt, "a", toks, aux, 60, 29)
        trees.append(rt.draft(["a"], [10], depth=4, topk=3)[0])
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents


def test_the_prefix_store_holds_at_most_its_positions(head):
    rt = _runtime(head, store_tokens=64)
    assert rt.store_bytes_max == 64 * ROW
    for i, rid in enumerate("abc"):
        toks, aux = _rows(200, 10 + i)
        rt.bind(rid, "tenant")
        _extend(rt, rid, toks, aux, 0, 200)
    assert len(rt.store) == 4 and rt.store_bytes == 64 * ROW


# ------------------------------------------------------------ held rows
def _proposer(prepare_linears=None, **cfg):
    from vllm_specplug.eagle3 import shipped_head_path
    from vllm_specplug.methods.eagle3_tree import Eagle3TreeConfig, Eagle3TreeProposer

    g = torch.Generator().manual_seed(0)
    ctx = ProposerContext(vocab_size=49152, hidden_size=576, num_speculative_tokens=8,
                          max_model_len=1024, device=torch.device("cpu"),
                          dtype=torch.float32, model_path="", tokenizer_path="",
                          embed_tokens=torch.randn(49152, 576, generator=g) * 0.05,
                          prepare_linears=prepare_linears)
    return Eagle3TreeProposer(Eagle3TreeConfig(head=shipped_head_path(), depth=3, topk=2,
                                               **cfg), ctx)


def _gated_prompt(rid: str, n: int, seed: int) -> StepRequest:
    """A prompt chunk while the cost-aware gate is closed (its rows are held)."""
    toks, aux = _rows(n, seed)
    return StepRequest(req_id=rid, token_ids=toks, num_prompt_tokens=n, sampled=False,
                       verified_pos=0, aux_hidden=aux, drafting=False)


def _fed(prop, rid: str) -> int:
    st = prop.runtime.states.get(rid)
    return 0 if st is None else st.n


def test_held_rows_of_all_requests_stay_under_max_total_held_mib():
    prop = _proposer(max_total_held_mib=1)  # 151 rows of 6912 bytes
    prop.propose([_gated_prompt("a", 100, 1)])
    assert prop.held_bytes == 100 * HELD_ROW and _fed(prop, "a") == 0
    prop.propose([_gated_prompt("b", 100, 2)])  # would pass 1 MiB: fed now
    assert _fed(prop, "b") == 100 and prop.held_bytes == 100 * HELD_ROW
    assert prop.report(prop.stats())["held_fed_at_cap"] == 1
    prop.propose([_gated_prompt("c", 50, 3)])  # fits beside a's rows
    assert _fed(prop, "c") == 0 and prop.held_bytes == 150 * HELD_ROW
    prop.remove_request("a")
    prop.remove_request("c")
    assert prop.held_bytes == 0



def test_held_bytes_follow_a_gated_request_step_by_step():
    # a prompt held, then decode steps whose gate stays closed (budget 0):
    # each adds a chunk of one row; the count is what the held tensors take
    prop = _proposer(max_total_held_mib=None)
    toks, aux = _rows(40, 7)
    prop.propose([_gated_prompt("a", 30, 7)])
    for pos in range(30, 40):
        prop.propose([StepRequest(req_id="a", token_ids=toks[:pos + 2], num_prompt_tokens=30,
                                  sampled=True, verified_pos=pos,
                                  aux_hidden=aux[pos:pos + 1], budget=0)])
        held = prop._deferred["a"][1]
        assert prop.held_bytes == sum(c.nbytes for c in held) == (pos + 1) * HELD_ROW
    assert _fed(prop, "a") == 0
    prop.remove_request("a")
    assert prop.held_bytes == 0


def test_memory_gauges_report_the_structures():
    prop = _proposer(max_total_held_mib=None)
    prop.propose([_gated_prompt("a", 200, 1)])
    s = prop.report(prop.stats())
    assert s["held_bytes"] == 200 * HELD_ROW and s["held_fed_at_cap"] == 0
    assert s["head_kv_bytes"] == 256 * ROW and s["kv_capped"] == 0


@pytest.mark.parametrize("screen", [True, False])
def test_only_the_layers_drafting_runs_get_a_packed_copy(screen):
    # the engine's GEMM kernels keep a packed copy of each weight they take:
    # the checkpoint's separate q/k/v/gate/up never run once fused, and a
    # screened LM head is read by rows only, so their copies would be waste
    packed: list[torch.nn.Linear] = []

    def prepare(module: torch.nn.Module, weight_dtype=None) -> int:
        packed.extend(m for m in module.modules() if isinstance(m, torch.nn.Linear))
        return 0

    prop = _proposer(prepare, screen_lm_head=screen)
    rt = prop.runtime
    head, ml = rt.head, rt.head.midlayer
    assert (rt.screen is not None) == screen
    runs = [head.fc, rt.layer.qkv_proj, ml.self_attn.o_proj, rt.layer.gate_up_proj,
            ml.mlp.down_proj] + ([] if screen else [head.lm_head])
    assert sorted(map(id, packed)) == sorted(map(id, runs))


@pytest.mark.parametrize("choice", ["float32", "bfloat16", "auto"])
def test_the_head_gemm_dtype_reaches_the_engines_kernels(choice, monkeypatch):
    from vllm_specplug.sources import eagle3_drafter

    asked: list = []

    def prepare(module: torch.nn.Module, weight_dtype=None) -> int:
        asked.append(weight_dtype)
        return 0

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    _proposer(prepare, head_gemm_dtype=choice)
    want = torch.bfloat16 if choice == "bfloat16" else torch.float32  # auto: no bf16 here
    assert asked and set(asked) == {want}
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert eagle3_drafter.head_gemm_dtype("auto") == torch.bfloat16
    assert eagle3_drafter.head_gemm_dtype("float32") == torch.float32
