"""Tree-row bookkeeping and the CPU path's attention. The GPU path on the
FLASH_ATTN/TRITON_ATTN caches is tested in
tests/kernels/test_runner_gpu_path.py (Triton interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers.paged_cache import paged_cache
from tests.runner.reference_attention import masked_tree_attention
from vllm_specplug.engine.tree import DraftTree

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


def test_paged_tree_attention_reads_the_cache_in_both_layouts():
    """The CPU path's attention over the paged cache (context split over
    non-consecutive blocks, a part-filled last block whose unused slots hold
    NaN) against a plain loop over queries and heads."""
    from vllm_specplug.runner.tree_attention import (
        cpu_split_cache,
        paged_tree_attention,
    )

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
        k_cache, v_cache = cpu_split_cache(paged_cache(kc, vc, blocks, nb, bs, layout))
        got = paged_tree_attention(q, k_cache, v_cache, blocks, c, ks, vs, bias,
                                   D ** -0.5, layout)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)



def _backend_attention(q, key_cache, value_cache, out, qsl, seq_lens, blocks, scale,
                       heads, kv_heads, d, isa="vec", sched=None):
    """vLLM's CPU attention kernel, called as ``CPUAttentionBackendImpl`` does."""
    from vllm import _custom_ops as ops

    if sched is None:
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
            seq_lens=seq_lens, dtype=torch.float32, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=blocks, softcap=0.0,
        scheduler_metadata=sched, s_aux=None)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("parents", [[-1, 0, 1, 0, 3, -1], [-1, -1, 1, 0]])
def test_tree_rows_with_the_backend_kernel(parents, compact, native, monkeypatch):
    """With real vLLM CPU kernels (``cpu_attn_reshape_and_cache`` writes the
    cache, ``cpu_attention_with_kv_cache`` attends): a decoding request and a
    tree request in one step. ``compact``: the backend runs on
    ``compact_cpu_metadata`` (the tree request ends at its root, the nodes
    are a dummy request) and ``cpu_tree_rows`` recomputes every node; else
    the backend attends every row causally and only the nodes after the
    tree's leading chain are recomputed (the kernel's rows are right for
    the chain). ``native``: the tree rows by the native kernel
    (kernels/cpu_tree_attention), else by the ATen path. Every row against
    the reference."""
    from vllm import _custom_ops as ops

    from vllm_specplug.kernels import cpu_tree_attention

    if native:
        assert cpu_tree_attention.ensure_loaded(), cpu_tree_attention._error
    else:
        monkeypatch.setenv(cpu_tree_attention.ENV_SWITCH, "0")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from vllm_specplug.runner.tree_attention import (
        TreeRow,
        TreeStep,
        compact_cpu_metadata,
        cpu_tree_rows,
    )

    g = torch.Generator().manual_seed(11)
    h, hkv, d, bs, nb = 4, 2, 64, 32, 12
    scale = d ** -0.5
    tree = DraftTree(list(range(1, len(parents) + 1)), parents)
    n, c0, c1 = len(tree), 45, 70  # request 0 decodes one token; request 1 verifies a tree
    lens = [c0 + 1, c1 + 1 + n]
    block_ids = [torch.tensor([3, 9], dtype=torch.int32), torch.tensor([5, 2, 7], dtype=torch.int32)]
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d)
    key_cache, value_cache = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    seqs = []
    for L, ids in zip(lens, block_ids):
        k, v = torch.randn(L, hkv, d, generator=g), torch.randn(L, hkv, d, generator=g)
        slots = torch.tensor([int(ids[i // bs]) * bs + i % bs for i in range(L)])
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
        seqs.append((k, v))
    q = torch.randn(2 + n, h, d, generator=g)  # rows: req 0's token, req 1's root + nodes
    blocks = torch.zeros(2, 3, dtype=torch.int32)
    blocks[0, :2], blocks[1] = block_ids[0], block_ids[1]
    qsl = torch.tensor([0, 1, 2 + n], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = CPUAttentionMetadata(
        num_actual_tokens=2 + n, max_query_len=1 + n, query_start_loc=qsl,
        max_seq_len=max(lens), seq_lens=seq_lens, block_table=blocks,
        slot_mapping=torch.zeros(0, dtype=torch.long), scheduler_metadata=None)
    mask = torch.from_numpy(tree.ancestor_mask()[1:])
    a = tree.chain_prefix()
    row = TreeRow(1, n, c1, 1, mask, chain_prefix=a)
    impl = SimpleNamespace(num_heads=h, num_kv_heads=hkv, head_size=d, sliding_window=-1,
                           kv_cache_dtype="auto")
    out = torch.full((2 + n, h, d), float("nan"))
    if compact:
        m = compact_cpu_metadata(meta, [row], impl, "vec", torch.float32)
        assert m.query_start_loc.tolist() == [0, 1, 2, 2 + n]
        assert m.seq_lens.tolist() == [c0 + 1, c1 + 1, n]
        assert m.block_table[1:].tolist() == [blocks[1].tolist()] * 2
        _backend_attention(q, key_cache, value_cache, out, m.query_start_loc, m.seq_lens,
                           m.block_table, scale, h, hkv, d, sched=m.scheduler_metadata)
        own = 2  # rows the kernel computed right: req 0's, the root
    else:
        _backend_attention(q, key_cache, value_cache, out, qsl, seq_lens, blocks, scale,
                           h, hkv, d)
        own = 2 + a  # ... and the leading chain's
    kernel = out.clone()
    step_k = torch.cat([seqs[0][0][c0:], seqs[1][0][c1:]])  # the step's own rows
    step_v = torch.cat([seqs[0][1][c0:], seqs[1][1][c1:]])
    cpu_tree_rows(TreeStep([row]), q, step_k, step_v, kv_cache, blocks, out, scale,
                  "k_transposed", all_nodes=compact)
    k0, v0 = seqs[0]
    k1, v1 = seqs[1]
    one = torch.ones(1, 1, dtype=torch.bool)
    want = torch.cat([
        masked_tree_attention(q[:1], k0[:c0], v0[:c0], k0[c0:], v0[c0:], one, scale),
        masked_tree_attention(q[1:2], k1[:c1], v1[:c1], k1[c1:c1 + 1], v1[c1:c1 + 1], one,
                              scale),
        masked_tree_attention(q[2:], k1[:c1], v1[:c1], k1[c1:], v1[c1:], mask, scale)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:own], kernel[:own])  # the kernel's own rows, untouched
    # the rows recomputed: not what the kernel left there
    assert not torch.allclose(kernel[own:], want[own:], atol=1e-3, equal_nan=True)


def test_native_calls_repointed_across_layers():
    """``cpu_tree_rows`` builds the native kernel's call on a step's first
    layer and re-points it at each next layer's tensors: every layer's rows
    equal those of a step that built its call afresh for that layer, and
    against the reference; a layer laid out otherwise (a query with other
    strides) gets a call of its own and is right too."""
    from vllm_specplug.kernels import cpu_tree_attention
    from vllm_specplug.runner.tree_attention import TreeRow, TreeStep, cpu_tree_rows

    assert cpu_tree_attention.ensure_loaded(), cpu_tree_attention._error
    g = torch.Generator().manual_seed(5)
    nb, c, scale = 8, 40, D ** -0.5
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 0, 1, -1])
    n = len(tree)
    mask = torch.from_numpy(tree.ancestor_mask()[1:])
    blocks = torch.tensor([[0, 0, 0, 0], [6, 1, 4, 0]], dtype=torch.int32)

    def layer():
        kc, vc = torch.randn(c, HKV, D, generator=g), torch.randn(c, HKV, D, generator=g)
        cache = paged_cache(kc, vc, blocks[1], nb, BS, "k_transposed")
        q = torch.randn(2 + n, H, D, generator=g)  # req 0's token, req 1's root + nodes
        ks, vs = torch.randn(2 + n, HKV, D, generator=g), torch.randn(2 + n, HKV, D, generator=g)
        return kc, vc, cache, q, ks, vs

    def run(step, kc, vc, cache, q, ks, vs):
        out = torch.zeros(2 + n, H, D)
        cpu_tree_rows(step, q, ks, vs, cache, blocks, out, scale, "k_transposed",
                      all_nodes=True)
        want = masked_tree_attention(q[2:], kc, vc, ks[1:], vs[1:], mask, scale)
        torch.testing.assert_close(out[2:], want, atol=1e-5, rtol=1e-5)
        return out

    def row():
        return TreeRow(1, n, c, 1, mask, chain_prefix=tree.chain_prefix())

    shared = TreeStep([row()])
    run(shared, *layer())
    assert len(shared.native) == 1
    call = next(iter(shared.native.values()))[0]
    for _ in range(2):
        tensors = layer()
        assert torch.equal(run(shared, *tensors), run(TreeStep([row()]), *tensors))
        assert next(iter(shared.native.values()))[0] is call  # re-pointed, not rebuilt
    kc, vc, cache, q, ks, vs = layer()
    wide = torch.zeros(2 + n, H, 2 * D)[:, :, :D]  # other strides: a call of its own
    wide.copy_(q)
    assert torch.equal(run(shared, kc, vc, cache, wide, ks, vs),
                       run(TreeStep([row()]), kc, vc, cache, q, ks, vs))
    assert next(iter(shared.native.values()))[0] is call
