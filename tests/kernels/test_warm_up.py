"""Start-up compilation of the GPU kernels (``kernels/warm_up.py``), run in
Triton's interpreter: the kernels launch for one and for two sequences (tree
attention in one pass and split) on the engine's own cache, and the cache is
left as it was."""

from __future__ import annotations

import torch

from vllm_specplug.kernels import kv_move, tree_attention
from vllm_specplug.kernels.warm_up import warm_up_gpu_kernels


def test_warm_up_launches_each_specialization_and_writes_nothing(monkeypatch):
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(tree_attention, "tree_attention_triton",
                        spy("attention", tree_attention.tree_attention_triton))
    monkeypatch.setattr(kv_move, "kv_move_triton", spy("move", kv_move.kv_move_triton))
    monkeypatch.setattr(kv_move, "kv_move_caches", spy("move_all", kv_move.kv_move_caches))
    head, kv_heads, block_size = 32, 2, 16
    # a block-size-major (NHD) layer cache seen as [blocks, kv_heads, block_size, 2*head]
    cache = torch.randn(6, block_size, kv_heads, 2 * head).permute(0, 2, 1, 3)
    before = cache.clone()
    warm_up_gpu_kernels(cache, head, 8, head ** -0.5, table_width=40, dtype=torch.float32)
    assert torch.equal(cache, before)
    attention = [(a, kw) for n, a, kw in calls if n == "attention"]
    moves = [a for n, a, _ in calls if n == "move"]
    # seq_lens: one and two sequences, each in one pass and split
    assert [(a[4].shape[0], kw["num_segments"]) for a, kw in attention] == \
        [(1, 1), (1, 2), (2, 1), (2, 2)]
    attention = [a for a, _ in attention]
    assert all(a[3].stride(0) == 40 for a in attention)  # the real block table's stride
    assert all(a[1].data_ptr() == cache.data_ptr() for a in attention)  # the engine's cache
    assert [a[2].shape[0] for a in moves] == [1, 2]
    # the KV move's one kernel (kv_move_caches), for this layer's K and V
    # together (one shape and strides: one launch pair), n = 1 and 2
    assert [(len(a[0]), a[1].shape[0]) for n, a, _ in calls if n == "move_all"] == \
        [(2, 1), (2, 2)]
