"""The attention wrapper's two ways to recompute tree rows agree with the
reference: the CPU path (context read from vLLM's CPU cache layout) and the
GPU path's wiring (FLASH_ATTN layout, packed masks, Triton kernel entry
point; here its torch fallback, the kernel itself is tested in
tests/triton_kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.runner.tree_attention import (
    TreeAttentionWrapper,
    TreeRow,
    TreeStep,
    masked_tree_attention,
)

H, HKV, D, BS = 4, 2, 32, 16


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    trees = [DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 2]), DraftTree([7, 8, 9], [-1, 0, -1])]
    ctx = [21, 40]  # tokens already cached before each root
    rows, start = [], 0
    for i, (t, c) in enumerate(zip(trees, ctx)):
        rows.append(TreeRow(start, len(t), c, i, torch.from_numpy(t.ancestor_mask()[1:])))
        start += len(t) + 1
    total = start
    q = torch.randn(total, H, D, generator=g)
    k = torch.randn(total, HKV, D, generator=g)
    v = torch.randn(total, HKV, D, generator=g)
    k_ctx = [torch.randn(c, HKV, D, generator=g) for c in ctx]
    v_ctx = [torch.randn(c, HKV, D, generator=g) for c in ctx]
    expected = torch.zeros(total, H, D)
    for r, kc, vc in zip(rows, k_ctx, v_ctx):
        s = r.row_start
        expected[s + 1 : s + 1 + r.num_nodes] = masked_tree_attention(
            q[s + 1 : s + 1 + r.num_nodes], kc, vc, k[s : s + 1 + r.num_nodes],
            v[s : s + 1 + r.num_nodes], r.mask, D ** -0.5)
    return rows, q, k, v, k_ctx, v_ctx, expected


def test_cuda_wiring_flash_layout():
    rows, q, k, v, k_ctx, v_ctx, expected = _case()
    nblocks = 16
    cache = torch.zeros(2, nblocks, BS, HKV, D)
    # Blocks handed out in a shuffled order; each sequence's keys = context +
    # root + nodes at linear slots, as vLLM writes them before attention.
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(1))
    block_table = perm.view(2, -1).to(torch.int32)
    for r, kc, vc in zip(rows, k_ctx, v_ctx):
        s = r.row_start
        keys = torch.cat([kc, k[s : s + 1 + r.num_nodes]])
        vals = torch.cat([vc, v[s : s + 1 + r.num_nodes]])
        for pos in range(keys.shape[0]):
            b = block_table[r.req_index, pos // BS]
            cache[0, b, pos % BS], cache[1, b, pos % BS] = keys[pos], vals[pos]
    impl = SimpleNamespace(num_heads=H, scale=D ** -0.5, forward=None)
    wrapper = TreeAttentionWrapper("l0", impl, lambda: None)
    out = torch.zeros_like(q)
    wrapper._fix_rows_cuda(TreeStep(rows), q, cache,
                           SimpleNamespace(block_table=block_table), out)
    for r in rows:
        s = r.row_start
        torch.testing.assert_close(out[s + 1 : s + 1 + r.num_nodes],
                                   expected[s + 1 : s + 1 + r.num_nodes],
                                   atol=1e-4, rtol=1e-4)


def test_masked_tree_attention_matches_per_query_softmax():
    """The CPU path's attention against a plain loop over queries and heads."""
    g = torch.Generator().manual_seed(3)
    n, c = 6, 37
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, -1, 4])
    mask = torch.from_numpy(tree.ancestor_mask()[1:])
    q = torch.randn(n, H, D, generator=g)
    kc, vc = torch.randn(c, HKV, D, generator=g), torch.randn(c, HKV, D, generator=g)
    ks, vs = torch.randn(n + 1, HKV, D, generator=g), torch.randn(n + 1, HKV, D, generator=g)
    got = masked_tree_attention(q, kc, vc, ks, vs, mask, D ** -0.5)
    keys, vals = torch.cat([kc, ks]), torch.cat([vc, vs])
    for i in range(n):
        visible = list(range(c)) + [c + j for j in range(n + 1) if mask[i, j]]
        for head in range(H):
            kv = head // (H // HKV)
            w = torch.softmax(keys[visible, kv] @ q[i, head] * D ** -0.5, dim=0)
            torch.testing.assert_close(got[i, head], w @ vals[visible, kv],
                                       atol=1e-5, rtol=1e-5)
