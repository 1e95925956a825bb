"""The runner's GPU path on the FLASH_ATTN and TRITON_ATTN backends' real KV
cache, without a GPU.

The cache is built by vLLM's own allocator code (``create_kv_cache_views``
for a ``FullAttentionSpec``) in every ``KVCacheLayout`` vLLM 0.32 can pick
(both backends accept any layout). K/V are written by each backend's own
``do_kv_cache_update`` (its ``transpose(1, 2).split(head_size)`` of the
layer cache); only the final scatter kernel it calls (CUDA's
``reshape_and_cache_flash`` / the Triton one vLLM disables on CPU) is replaced
by the same scatter in torch. Then the attention wrapper's GPU path runs the
Triton tree kernel (interpreter) on that cache and its rows are compared with
the reference attention (``tests/runner/reference_attention.py``) on the original K/V, and
the accepted-path KV move (``kv_move`` kernel, interpreter) is checked slot by
slot through the backend's own split.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.engine.tree import DraftTree

H, HKV, D, BS, NUM_BLOCKS, LAYERS = 4, 2, 32, 16, 12, 2


def _torch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *args):
    """``reshape_and_cache_flash``'s semantics: row i -> slot_mapping[i]
    (negative = skip) of K/V caches ``[blocks, block_size, kv_heads, head]``."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    keep = slots >= 0
    s = slots[keep]
    key_cache[s // key_cache.shape[1], s % key_cache.shape[1]] = key[:n][keep]
    value_cache[s // value_cache.shape[1], s % value_cache.shape[1]] = value[:n][keep]


def _writer(backend: str, monkeypatch):
    """The backend's own ``do_kv_cache_update`` bound to an impl."""
    from vllm.config import VllmConfig, set_current_vllm_config

    if backend == "FLASH_ATTN":
        import vllm.v1.attention.backends.flash_attn as fa

        # Imported by flash_attn.py only where the CUDA flash-attn build exists.
        monkeypatch.setattr(fa, "reshape_and_cache_flash", _torch_reshape_and_cache,
                            raising=False)
        # FlashAttentionImpl's constructor probes the CUDA flash-attn build;
        # do_kv_cache_update itself reads only these fields.
        impl = SimpleNamespace(attn_type="decoder", head_size=D, kv_cache_dtype="auto")
        return impl, lambda *a: fa.FlashAttentionImpl.do_kv_cache_update(impl, *a)
    import vllm.v1.attention.backends.triton_attn as ta

    monkeypatch.setattr(ta, "triton_reshape_and_cache_flash", _torch_reshape_and_cache)
    with set_current_vllm_config(VllmConfig()):
        impl = ta.TritonAttentionImpl(num_heads=H, head_size=D, scale=D ** -0.5,
                                      num_kv_heads=HKV, alibi_slopes=None,
                                      sliding_window=None, kv_cache_dtype="auto")
    return impl, impl.do_kv_cache_update


def _layer_caches(layout):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                             dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, LAYERS,
                                                            layout)
    names = [f"l{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=LAYERS * NUM_BLOCKS * spec.page_size_bytes, layers=names,
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    assert views[0].shape == (NUM_BLOCKS, HKV, BS, 2 * D)
    return dict(zip(names, views))


def _batch(seed=0):
    """Three requests: a tree with 2 rows scheduled before its root (vLLM puts
    the root at the first of the last m+1 rows), a plain decode, a tree."""
    from vllm_specplug.runner.runner import root_rows
    from vllm_specplug.runner.tree_attention import TreeRow

    g = torch.Generator().manual_seed(seed)
    trees = {0: DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 2]),
             2: DraftTree([7, 8, 9], [-1, 0, -1])}
    computed = [21, 40, 37]  # tokens in the cache before this step's rows
    ahead = [2, 0, 0]  # rows scheduled before the root
    drafts = np.asarray([len(trees[i]) if i in trees else 0 for i in range(3)])
    n_rows = np.asarray(ahead) + 1 + drafts
    qsl = np.concatenate([[0], np.cumsum(n_rows)])
    roots = root_rows(qsl, drafts)
    total = int(qsl[-1])
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    block_table = perm[:9].view(3, 3).to(torch.int32)
    slots, rows = torch.empty(total, dtype=torch.long), []
    ctx_k = [torch.randn(c, HKV, D, generator=g) for c in computed]
    ctx_v = [torch.randn(c, HKV, D, generator=g) for c in computed]
    for i in range(3):
        for r in range(int(qsl[i]), int(qsl[i + 1])):
            pos = computed[i] + r - int(qsl[i])
            slots[r] = int(block_table[i, pos // BS]) * BS + pos % BS
        if i in trees:
            s = int(roots[i])
            c = computed[i] + s - int(qsl[i])
            rows.append(TreeRow(s, len(trees[i]), c, i,
                                torch.from_numpy(trees[i].ancestor_mask()[1:])))
    q = torch.randn(total, H, D, generator=g)
    k = torch.randn(total, HKV, D, generator=g)
    v = torch.randn(total, HKV, D, generator=g)
    return SimpleNamespace(rows=rows, q=q, k=k, v=v, ctx_k=ctx_k, ctx_v=ctx_v,
                           block_table=block_table, slots=slots, computed=computed,
                           qsl=qsl)


def _write(b, caches, write):
    """Context (earlier steps) and this step's rows, each through the writer."""
    for kv in caches.values():
        layer = SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
        for i, c in enumerate(b.computed):
            ctx_slots = torch.tensor([int(b.block_table[i, p // BS]) * BS + p % BS
                                      for p in range(c)])
            write(layer, b.ctx_k[i], b.ctx_v[i], kv, ctx_slots)
        write(layer, b.k, b.v, kv, b.slots)


def _expected_rows(b):
    """The reference attention of each tree row, from the original K/V: the
    context is every cached token before the root (earlier steps' plus the
    rows scheduled ahead of it this step)."""
    from tests.runner.reference_attention import masked_tree_attention

    out = {}
    for r in b.rows:
        s, i, first = r.row_start, r.req_index, int(b.qsl[r.req_index])
        k_ctx = torch.cat([b.ctx_k[i], b.k[first:s]])
        v_ctx = torch.cat([b.ctx_v[i], b.v[first:s]])
        out[s] = masked_tree_attention(
            b.q[s + 1 : s + 1 + r.num_nodes], k_ctx, v_ctx,
            b.k[s : s + 1 + r.num_nodes], b.v[s : s + 1 + r.num_nodes], r.mask,
            D ** -0.5)
    return out


def _layouts():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
@pytest.mark.parametrize("layout", _layouts(), ids=lambda x: x.name)
def test_tree_rows_and_kv_move_on_backend_cache(backend, layout, monkeypatch):
    from vllm_specplug.runner.tree_attention import (
        LayerMoves,
        TreeAttentionWrapper,
        TreeStep,
        gpu_split_cache,
        move_accepted_kv,
    )

    from vllm_specplug.kernels import kernel_is_interpreted
    from vllm_specplug.kernels.kv_move import _kv_gather_kernel
    from vllm_specplug.kernels.tree_attention import _tree_attention_kernel

    # The Triton kernels themselves run, not their torch fallbacks.
    assert kernel_is_interpreted(_tree_attention_kernel)
    assert kernel_is_interpreted(_kv_gather_kernel)
    impl, write = _writer(backend, monkeypatch)
    caches = _layer_caches(layout)
    b = _batch()
    _write(b, caches, write)
    step = TreeStep(b.rows)
    meta = SimpleNamespace(block_table=b.block_table, slot_mapping=b.slots)
    expected = _expected_rows(b)
    for name, kv in caches.items():
        fake_impl = SimpleNamespace(num_heads=H, head_size=D, scale=D ** -0.5,
                                    forward=lambda *a, **kw: None)
        wrapper = TreeAttentionWrapper(name, fake_impl, lambda: step, gpu=True)
        out = torch.zeros(b.q.shape[0], H * D)
        wrapper(SimpleNamespace(), b.q, b.k, b.v, kv, meta, out)
        o = out.view(-1, H, D)
        for r in b.rows:
            s = r.row_start
            torch.testing.assert_close(o[s + 1 : s + 1 + r.num_nodes], expected[s],
                                       atol=1e-4, rtol=1e-4)
    assert set(step.caches) == set(caches)

    # Accepted paths: request 0 takes nodes [1, 3] (rows root+2, root+4 go to
    # root+1, root+2), request 2 takes node [2] (root+3 -> root+1).
    r0, r2 = b.rows
    src = [r0.row_start + 2, r0.row_start + 4, r2.row_start + 3]
    dst = [r0.row_start + 1, r0.row_start + 2, r2.row_start + 1]
    before = {n: kv.clone() for n, kv in caches.items()}
    import vllm_specplug.kernels.kv_move as kv_move_module

    batched = []  # every layer's K and V in one gather-scatter launch pair
    real = kv_move_module.kv_move_caches
    monkeypatch.setattr(kv_move_module, "kv_move_caches",
                        lambda views, *a: batched.append(len(views)) or real(views, *a))
    moves = LayerMoves(D, "gpu")
    move_accepted_kv(step, src, dst, moves)
    assert batched == [2 * len(caches)]
    table = moves.table
    move_accepted_kv(step, dst[:1], dst[:1], moves)  # src == dst: nothing to copy
    assert batched == [2 * len(caches)] * 2 and moves.table is table  # built once
    for name, kv in caches.items():
        k_cache, v_cache = gpu_split_cache(kv, D)
        want = before[name].clone()
        wk, wv = gpu_split_cache(want, D)
        for s_row, d_row in zip(src, dst):
            d = int(b.slots[d_row])
            wk[d // BS, d % BS] = b.k[s_row]
            wv[d // BS, d % BS] = b.v[s_row]
        assert torch.equal(kv, want), name
        for s_row, d_row in zip(src, dst):
            d = int(b.slots[d_row])
            assert torch.equal(k_cache[d // BS, d % BS], b.k[s_row])
            assert torch.equal(v_cache[d // BS, d % BS], b.v[s_row])


def _interpreted_unified_attention(monkeypatch):
    """vLLM's own TRITON_ATTN kernel, decorated by Triton itself for its
    interpreter (vLLM's CPU build imports its kernels with placeholders in
    Triton's place) and put where the backend's forward calls it."""
    import importlib

    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as tu
    import vllm.v1.attention.backends.triton_attn as ta
    import vllm.v1.attention.ops.triton_attention_helpers as helpers
    import vllm.v1.attention.ops.triton_unified_attention as tua

    for name, real in (("triton", triton), ("tl", tl), ("tldevice", tldevice)):
        monkeypatch.setattr(tu, name, real)
    importlib.reload(helpers)
    importlib.reload(tua)
    monkeypatch.setattr(ta, "unified_attention", tua.unified_attention)


def _causal_rows(b):
    """The reference attention of every row, each seeing its request's
    context and the rows up to itself (what a causal backend computes)."""
    out = torch.empty_like(b.q)
    rep = H // HKV
    for i in range(len(b.computed)):
        first, end = int(b.qsl[i]), int(b.qsl[i + 1])
        for r in range(first, end):
            k = torch.cat([b.ctx_k[i], b.k[first : r + 1]]).repeat_interleave(rep, 1)
            v = torch.cat([b.ctx_v[i], b.v[first : r + 1]]).repeat_interleave(rep, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", b.q[r], k) * D ** -0.5, -1)
            out[r] = torch.einsum("hk,khd->hd", w, v)
    return out


@pytest.mark.parametrize("compact", [True, False])
def test_triton_attn_backend_skips_the_nodes(compact, monkeypatch):
    """TRITON_ATTN's own forward (vLLM's kernel, interpreted) under the
    wrapper: with the nodes taken out of its call (``compact_triton_metadata``)
    every row is what it is with the backend attending them all: the
    reference's causal rows outside the trees, the tree reference on the
    nodes."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_specplug.runner.tree_attention import TreeAttentionWrapper, TreeStep

    _interpreted_unified_attention(monkeypatch)
    impl, write = _writer("TRITON_ATTN", monkeypatch)
    caches = _layer_caches(list(KVCacheLayout)[0])
    b = _batch()
    _write(b, caches, write)
    q_lens = np.diff(b.qsl)
    seq_lens = np.asarray(b.computed) + q_lens
    meta = TritonAttentionMetadata(
        num_actual_tokens=int(b.qsl[-1]), max_query_len=int(q_lens.max()),
        query_start_loc=torch.as_tensor(b.qsl, dtype=torch.int32),
        max_seq_len=int(seq_lens.max()),
        seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32),
        block_table=b.block_table, slot_mapping=b.slots, seq_threshold_3D=0,
        num_par_softmax_segments=16, softmax_segm_output=torch.empty(0),
        softmax_segm_max=torch.empty(0), softmax_segm_expsum=torch.empty(0), causal=True)
    step = TreeStep(b.rows, query_start_loc=b.qsl if compact else None)
    seen = []
    real = type(impl).forward

    def forward(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        seen.append((attn_metadata.query_start_loc.tolist(), attn_metadata.seq_lens.tolist(),
                     attn_metadata.max_query_len))
        return real(impl, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)

    impl.forward = forward
    wrapper = TreeAttentionWrapper("l0", impl, lambda: step, gpu=True)
    layer = SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()),
                            _q_scale=torch.ones(()))
    o = torch.zeros(b.q.shape[0], H, D)  # vLLM's Attention layer hands [tokens, heads, head]
    wrapper(layer, b.q, b.k, b.v, caches["l0"], meta, o)
    want = _causal_rows(b)
    for r, rows in _expected_rows(b).items():
        n = rows.shape[0]
        want[r + 1 : r + 1 + n] = rows
    torch.testing.assert_close(o, want, atol=1e-4, rtol=1e-4)
    r0, r2 = b.rows  # request 1 is a plain decode
    if compact:  # each tree ends at its root; its nodes are a request of their own
        assert seen == [([0, r0.row_start + 1, 8, 9, r2.row_start + 1, 13],
                         [r0.context_len + 1, r0.num_nodes, 41, r2.context_len + 1,
                          r2.num_nodes], r0.num_nodes)]
    else:
        assert seen == [(b.qsl.tolist(), seq_lens.tolist(), int(q_lens.max()))]
