"""kv_move_triton (interpreted) vs. a gather-then-scatter oracle."""

import pytest
import torch

from vllm_specplug.kernels.kv_move import kv_move, kv_move_ref, kv_move_triton

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 5, 16, 3, 24  # odd head count / dim


def _caches(num_layers=None, dtype=torch.float32, seed=0):
    """K/V as the halves of one vLLM-style ``[2, (L,) blocks, ...]`` tensor (strided views)."""
    gen = torch.Generator().manual_seed(seed)
    lead = () if num_layers is None else (num_layers,)
    kv = torch.randn(2, *lead, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, generator=gen)
    if num_layers is not None:
        kv = kv.transpose(0, 1)  # [L, 2, ...]: each layer's K and V interleaved in memory
    return kv.to(dtype).unbind(0 if num_layers is None else 1)


def _oracle(cache, src, dst):
    """Slot-level copy: read every source first, then write."""
    out = cache.clone()
    flat_in = cache.reshape(*cache.shape[:-4], -1, NUM_HEADS, HEAD_DIM)
    flat_out = out.view(*cache.shape[:-4], -1, NUM_HEADS, HEAD_DIM)
    for s, d in zip(src.tolist(), dst.tolist()):
        if s != d and s >= 0 and d >= 0:
            flat_out[..., d, :, :] = flat_in[..., s, :, :]
    return out


CASES = {
    "compact_down": ([5, 7, 9], [5, 6, 7]),  # the accepted-path case, src == dst skipped
    "shift_up": ([3, 4, 5, 6], [4, 5, 6, 7]),  # dst > src: naive in-order copy breaks
    "swap": ([10, 30], [30, 10]),
    "cycle": ([1, 2, 3, 4], [2, 3, 4, 1]),
    "cross_block": ([14, 15, 16, 17, 40], [31, 32, 33, 34, 2]),
    "padding": ([8, -1, 12, 3], [9, 4, -1, 3]),  # -1 and src == dst entries are no-ops
    "fan_out": ([20, 20, 20], [21, 22, 0]),  # repeated source
}


@pytest.mark.parametrize("order", ["forward", "reversed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapping_moves(case, order, request):
    if order == "reversed":
        request.getfixturevalue("reversed_programs")
    src, dst = (torch.tensor(x, dtype=torch.int64) for x in CASES[case])
    k_cache, v_cache = _caches(seed=len(src))
    want_k, want_v = _oracle(k_cache, src, dst), _oracle(v_cache, src, dst)
    kv_move_triton(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("num_layers", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_moves(num_layers, dtype):
    gen = torch.Generator().manual_seed(11)
    num_slots = NUM_BLOCKS * BLOCK_SIZE
    n = 23
    dst = torch.randperm(num_slots, generator=gen)[:n]  # distinct destinations
    src = torch.randint(0, num_slots, (n,), generator=gen)
    src[:4] = dst[:4]
    src[4:9] = dst[9:14]  # chains: some sources are also destinations
    k_cache, v_cache = _caches(num_layers, dtype, seed=12)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want_k, want_v = _oracle(k_cache, src, dst), _oracle(v_cache, src, dst)
    kv_move_triton(k_cache, v_cache, src, dst)
    kv_move_ref(k_ref, v_ref, src, dst)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_ref, want_k) and torch.equal(v_ref, want_v)


def test_layer_list_and_dispatch():
    src = torch.tensor([7, 8, 9, 33])
    dst = torch.tensor([8, 9, 10, 7])
    layers = [_caches(seed=s) for s in range(2)]
    ks, vs = [k for k, _ in layers], [v for _, v in layers]
    want = [_oracle(c, src, dst) for c in ks + vs]
    kv_move(ks, vs, src, dst)
    for got, exp in zip(ks + vs, want):
        assert torch.equal(got, exp)
    # v_cache=None: single-cache layouts
    k, _ = _caches(seed=9)
    want_k = _oracle(k, src, dst)
    kv_move_triton(k, None, src, dst)
    assert torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hnd", [False, True])
def test_every_layer_in_one_launch_pair(dtype, hnd):
    """kv_move_caches over separately allocated layer caches, each split as
    FLASH_ATTN/TRITON_ATTN split it (``[blocks, kv_heads, block_size,
    2*head]`` -> K and V views; HND: heads outer in memory), equals the
    oracle layer by layer."""
    from vllm_specplug.kernels.cache_layout import gpu_split_cache
    from vllm_specplug.kernels.kv_move import cache_table, kv_move_caches

    gen = torch.Generator().manual_seed(3)
    layers = []
    for _ in range(4):  # one allocation each, as vLLM allocates them
        if hnd:
            raw = torch.randn(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen)
        else:
            raw = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, 2 * HEAD_DIM,
                              generator=gen).transpose(1, 2)
        layers.append(raw.to(dtype))
    views = [v for raw in layers for v in gpu_split_cache(raw, HEAD_DIM)]
    src, dst = (torch.tensor(x, dtype=torch.int64) for x in CASES["cross_block"])

    def oracle(view):  # slot by slot on the (strided) 4-D view: read all, then write
        out, rows = view.clone(), [view[s // BLOCK_SIZE, s % BLOCK_SIZE].clone()
                                   for s in src.tolist()]
        for d, row in zip(dst.tolist(), rows):
            out[d // BLOCK_SIZE, d % BLOCK_SIZE] = row
        return out

    want = [oracle(v) for v in views]
    kv_move_caches(views, src, dst, cache_table(views))
    for got, exp in zip(views, want):
        assert torch.equal(got, exp)


def test_one_launch_pair_refuses_caches_of_different_shapes():
    from vllm_specplug.kernels.kv_move import cache_table

    k, v = _caches(seed=1)
    with pytest.raises(ValueError, match="one shape"):
        cache_table([k, v[:2]])


@pytest.mark.parametrize("num_layers", [None, 3])
def test_k_and_v_in_one_launch_pair_unless_their_strides_differ(num_layers, monkeypatch):
    """K and V (every layer of a stacked cache too) share one gather-scatter
    pair; a V of other strides than K gets a pair of its own, same result."""
    import vllm_specplug.kernels.kv_move as kv_move_module

    launches = []
    real = kv_move_module.kv_move_caches
    monkeypatch.setattr(kv_move_module, "kv_move_caches",
                        lambda caches, *a: launches.append(len(caches)) or real(caches, *a))
    src, dst = (torch.tensor(x, dtype=torch.int64) for x in CASES["cycle"])
    layers = 1 if num_layers is None else num_layers
    k_cache, v_cache = _caches(num_layers, seed=5)
    want_k, want_v = _oracle(k_cache, src, dst), _oracle(v_cache, src, dst)
    kv_move_triton(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert launches == [2 * layers]

    launches.clear()
    # the same values with block offsets outer in memory: other strides
    v_other = v_cache.transpose(-4, -3).contiguous().transpose(-4, -3)
    want_k, want_v = _oracle(k_cache, src, dst), _oracle(v_cache, src, dst)
    kv_move_triton(k_cache, v_other, src, dst)
    assert torch.equal(k_cache, want_k) and torch.equal(v_other, want_v)
    assert launches == [layers, layers]
