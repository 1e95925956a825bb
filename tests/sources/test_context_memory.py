"""ContextMemory: per-request tokens + layer states + top-k, bounded, freed."""

import gc
import tracemalloc
import weakref

import numpy as np
import pytest
import torch

from vllm_specplug.sources.context_memory import (
    ContextMemory,
    ContextMemoryStore,
    bf16_to_f32,
    f16_to_f32,
    f32_to_bf16,
)

H, K = 8, 3


def rows_for(positions, hidden=H):
    """Hidden row of absolute position p: all entries p+1 (so recognizable)."""
    pos = torch.as_tensor(np.asarray(positions), dtype=torch.float32)
    return (pos[:, None] + 1).repeat(1, hidden)


def topk_for(positions):
    pos = torch.as_tensor(np.asarray(positions), dtype=torch.int64)
    ids = torch.stack([pos * 10 + j for j in range(K)], dim=1)
    probs = torch.tensor([[0.5, 0.3, 0.2]]).repeat(len(pos), 1)
    return ids, probs


def run_steps(mem, total, prompt, step=3):
    """Prefill ``prompt`` tokens, then decode ``step`` tokens at a time, rows
    as a runner would give them (token id of position p is p)."""
    tokens = np.arange(total, dtype=np.int64)
    length = prompt + 1  # the prompt plus the first sampled token
    pos = np.arange(0, prompt)
    mem.update(tokens[:length], 0, rows_for(pos), *topk_for(pos))
    while length < total:
        new_len = min(total, length + step)
        pos = np.arange(length - 1, new_len - 1)  # root + accepted
        mem.update(tokens[:new_len], length - 1, rows_for(pos), *topk_for(pos))
        length = new_len
    return tokens


def check_consistent(mem):
    slots = np.arange(mem.n)
    pos = mem.positions_of(slots)
    assert np.array_equal(mem.tokens[: mem.n], pos)  # token id == position
    assert np.array_equal(mem.slots_of(pos), slots)
    filled = mem.has_hidden[: mem.n]
    np.testing.assert_allclose(mem.hidden_f32(np.flatnonzero(filled))[:, 0],
                               pos[filled] + 1, rtol=1 / 256)  # bf16: 8-bit mantissa
    np.testing.assert_allclose(
        mem.inv_norm[: mem.n][filled], 1 / ((pos[filled] + 1) * np.sqrt(H)), rtol=1e-3
    )
    assert np.array_equal(mem.topk_ids[: mem.n][mem.has_topk[: mem.n]][:, 1],
                          pos[mem.has_topk[: mem.n]] * 10 + 1)


def test_prefill_then_decode_rows():
    mem = ContextMemory(H, K, max_positions=1024, initial_capacity=4)
    run_steps(mem, total=40, prompt=10)
    assert mem.n == mem.total == 40
    assert not mem.evicted
    # every position but the last (not read by the target yet) has its rows
    assert mem.has_hidden[:39].all() and not mem.has_hidden[39]
    assert mem.has_topk[:39].all() and not mem.has_topk[39]
    assert mem.hidden.dtype == np.uint16 and mem.hidden_format == "bfloat16"
    check_consistent(mem)
    assert np.array_equal(mem.continuation(35, 10), [36, 37, 38, 39])


def test_prompt_topk_of_the_last_rows_only_lands_where_it_belongs():
    # the runner's prompt chunk: hidden rows for all of it, top-k only for
    # its last 3 rows (Needs.prefill_topk_rows), placed by topk_offset
    mem = ContextMemory(H, K, max_positions=1024)
    pos = np.arange(10)
    mem.update(np.arange(11), 0, rows_for(pos), *topk_for(pos[7:]), topk_offset=7)
    assert mem.has_hidden[:10].all()
    assert np.array_equal(np.flatnonzero(mem.has_topk[: mem.n]), [7, 8, 9])
    check_consistent(mem)


def test_growable_capacity_doubles_up_to_cap():
    mem = ContextMemory(H, K, max_positions=100, head_positions=0, initial_capacity=4)
    caps = set()
    for n in range(1, 100):
        mem.update(np.arange(n), 0)
        caps.add(mem.capacity)
    assert caps == {4, 8, 16, 32, 64, 100}


def test_numpy_bf16_and_missing_probs():
    mem = ContextMemory(H, K, max_positions=64)
    toks = np.arange(5)
    mem.update(toks, 0, torch.ones(4, H, dtype=torch.bfloat16), torch.tensor([[3, 2, 1]] * 4))
    assert mem.has_hidden[:4].all() and np.all(mem.hidden_f32(np.arange(4)) == 1)
    probs = mem.topk_probs[0].astype(np.float32)
    assert probs[0] > probs[1] > probs[2]  # rank order kept
    mem.update(np.arange(7), 4, np.full((2, H), 2.0), np.array([[9, 8, 7, 6]] * 2))
    assert np.all(mem.hidden_f32(np.arange(4, 6)) == 2) and list(mem.topk_ids[5]) == [9, 8, 7]


def test_16bit_codecs_match_torch():
    x = torch.randn(1000) * torch.logspace(-3, 5, 1000)
    want = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16(x.numpy()), want)  # round to nearest even
    np.testing.assert_array_equal(bf16_to_f32(want), x.bfloat16().float().numpy())
    h = x.clamp(-6e4, 6e4).half()
    np.testing.assert_array_equal(f16_to_f32(h.numpy()), h.float().numpy())


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_hidden_formats_round_trip_and_norm_exact(fmt):
    mem = ContextMemory(4, 0, max_positions=16, hidden_format=fmt)
    x = np.array([[1e6, 0.0, 0.0, 0.0], [0.1, -2.5, 3.14159, 0.0]], dtype=np.float32)
    mem.update(np.arange(3), 0, torch.from_numpy(x))
    got = mem.hidden_f32(np.arange(2))
    assert np.isfinite(got).all()
    if fmt == "float16":
        assert got[0, 0] == 65504  # saturates
    else:
        assert got[0, 0] == pytest.approx(1e6, rel=1 / 256)
    np.testing.assert_allclose(got[1], x[1], rtol=1 / 256 if fmt == "bfloat16" else 1e-3)
    # the inverse norm comes from the fp32 input, not the 16-bit copy
    np.testing.assert_allclose(mem.inv_norm[:2], 1 / np.linalg.norm(x, axis=1), rtol=1e-6)
    with pytest.raises(ValueError):
        ContextMemory(4, 0, 16, hidden_format="int8")


@pytest.mark.parametrize("head", [0, 16])
def test_cap_keeps_head_and_recent_tail(head):
    cap = 64
    mem = ContextMemory(H, K, max_positions=cap, head_positions=head, initial_capacity=8)
    run_steps(mem, total=500, prompt=20)
    assert mem.n <= cap and mem.capacity == cap
    assert mem.total == 500 and mem.evicted
    pos = mem.positions_of(np.arange(mem.n))
    assert np.array_equal(pos[:head], np.arange(head))
    assert pos[-1] == 499  # the most recent position is kept
    assert np.all(np.diff(pos[head:]) == 1)
    assert mem.n - head >= (cap - head) - (cap - head) // 8  # chunked eviction
    check_consistent(mem)
    # dropped positions are gone, continuations stop at the head/tail gap
    assert mem.slot_of(head + 5) == -1
    if head:
        assert len(mem.continuation(head - 3, 10)) == 2
        assert not mem.has_next(np.array([head - 1]))[0]
        assert not mem.has_prev(np.array([head]))[0]
    assert mem.has_prev(np.array([head + 1]))[0]


def test_prompt_longer_than_cap_in_one_chunk():
    mem = ContextMemory(H, K, max_positions=64, head_positions=8)
    tokens = np.arange(301)
    pos = np.arange(300)
    mem.update(tokens, 0, rows_for(pos), *topk_for(pos))
    assert mem.n == 64
    assert np.array_equal(mem.positions_of(np.arange(8)), np.arange(8))
    assert mem.positions_of(np.array([63]))[0] == 300
    check_consistent(mem)
    assert mem.has_hidden[:63].all()


def test_history_shrinking_resets():
    mem = ContextMemory(H, K, max_positions=64)
    mem.update(np.arange(20), 0, rows_for(np.arange(19)))
    mem.update(np.array([7, 7, 7]), 0)
    assert mem.n == 3 and mem.total == 3 and not mem.has_hidden[:3].any()


def test_store_frees_memory_after_200_cycles():
    store = ContextMemoryStore(32, 4, max_positions=512, head_positions=64)
    tokens = np.arange(1025)  # over the cap: eviction runs too
    hidden = torch.randn(1024, 32)
    ids, probs = torch.randint(0, 100, (1024, 4)), torch.rand(1024, 4)

    def cycle(i):
        mem = store.get(f"r{i}")
        mem.update(tokens, 0, hidden, ids, probs)
        assert store.nbytes > 0
        ref = weakref.ref(mem)
        store.remove(f"r{i}")
        return ref

    for i in range(5):
        cycle(i)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        refs = [cycle(i) for i in range(200)]
        gc.collect()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(store) == 0 and store.nbytes == 0
    assert all(r() is None for r in refs)
    assert peak - base > 30_000  # the arrays were traced while alive
    assert now - base < 64 * 1024  # and nothing of them stays
