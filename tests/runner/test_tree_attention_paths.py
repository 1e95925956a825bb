"""Tree-row bookkeeping and the CPU path's attention. The GPU path on the
FLASH_ATTN/TRITON_ATTN caches is tested in
tests/kernels/test_runner_gpu_path.py (Triton interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specplug.engine.tree import DraftTree
from tests.runner.reference_attention import masked_tree_attention

H, HKV, D, BS = 4, 2, 32, 16


def test_root_rows_follow_vllm_logits_indices():
    """The root of a request with m drafts is the first of its last m+1 rows:
    checked against vLLM's own ``_calc_spec_decode_metadata`` (the row its
    first logits come from), with requests that have rows scheduled ahead."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specplug.runner.runner import root_rows

    num_draft = np.asarray([3, 0, 2, 0, 1], dtype=np.int32)
    num_sched = np.asarray([4, 100, 3, 100, 5], dtype=np.int32)  # 5: 3 rows ahead
    cu = np.cumsum(num_sched).astype(np.int32)
    fake = SimpleNamespace(_arange_scratch=np.zeros(1024, dtype=np.int32),
                           arange_np=np.arange(1024, dtype=np.int64),
                           device="cpu",
                           input_ids=SimpleNamespace(gpu=torch.zeros(int(cu[-1]),
                                                                     dtype=torch.int32)))
    fake._get_cumsum_and_arange = GPUModelRunner._get_cumsum_and_arange.__get__(fake)
    meta = GPUModelRunner._calc_spec_decode_metadata(fake, num_draft, cu)
    first_logit = np.concatenate([[0], meta.cu_num_sampled_tokens.numpy()[:-1]])
    vllm_roots = meta.logits_indices.numpy()[first_logit]
    qsl = np.concatenate([[0], cu])
    assert root_rows(qsl, num_draft).tolist() == vllm_roots.tolist()
    assert vllm_roots[4] != qsl[4]  # the case a "first row" root gets wrong


def test_masked_tree_attention_matches_per_query_softmax():
    """The reference attention (on gathered K/V) against a plain loop over
    queries and heads."""
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


def _paged(k_ctx, v_ctx, blocks, nb, bs, layout):
    """A vLLM CPU cache ``[nb, Hkv, bs, 2D]`` holding the context at ``blocks``,
    written by hand in ``layout`` (k_transposed: a key block is [Hkv, D, bs])."""
    c, hkv, d = k_ctx.shape
    cache = torch.full((nb, hkv, bs, 2 * d), float("nan"))
    kv = cache.view(nb, hkv, 2 * bs, d)
    for pos in range(c):
        b, t = int(blocks[pos // bs]), pos % bs
        for h in range(hkv):
            if layout == "k_transposed":
                kv[b, h, :bs].reshape(d, bs)[:, t] = k_ctx[pos, h]
            else:
                kv[b, h, t] = k_ctx[pos, h]
            kv[b, h, bs + t] = v_ctx[pos, h]
    return cache


def test_paged_tree_attention_reads_the_cache_in_both_layouts():
    """The CPU path's attention over the paged cache (context split over
    non-consecutive blocks, a part-filled last block whose unused slots hold
    NaN) against a plain loop over queries and heads."""
    from vllm_specplug.runner.tree_attention import cpu_split_cache, paged_tree_attention

    g = torch.Generator().manual_seed(5)
    n, c, bs, nb = 5, 37, 16, 8
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 0, 2, -1])
    mask = torch.from_numpy(tree.ancestor_mask()[1:])
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    q = torch.randn(n, H, D, generator=g)
    kc, vc = torch.randn(c, HKV, D, generator=g), torch.randn(c, HKV, D, generator=g)
    ks, vs = torch.randn(n + 1, HKV, D, generator=g), torch.randn(n + 1, HKV, D, generator=g)
    blocks = torch.tensor([6, 1, 4, 0], dtype=torch.int32)
    keys, vals = torch.cat([kc, ks]), torch.cat([vc, vs])
    want = torch.empty(n, H, D)
    for i in range(n):
        visible = list(range(c)) + [c + j for j in range(n + 1) if mask[i, j]]
        for head in range(H):
            kv = head // (H // HKV)
            w = torch.softmax(keys[visible, kv] @ q[i, head] * D ** -0.5, dim=0)
            want[i, head] = w @ vals[visible, kv]
    for layout in ("k_transposed", "plain"):
        k_cache, v_cache = cpu_split_cache(_paged(kc, vc, blocks, nb, bs, layout))
        got = paged_tree_attention(q, k_cache, v_cache, blocks, c, ks, vs, bias,
                                   D ** -0.5, layout)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
