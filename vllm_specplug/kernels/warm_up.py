"""Compile the GPU tree kernels at start-up, not at the first tree request.

Triton compiles a kernel at its first launch for each specialization of its
arguments: the constexprs (head size, GQA group, dtype precision, split KV or
not) and, per integer argument not excluded, whether it equals 1 or is
divisible by 16. The counts that change every step (sequences, tokens, moved
slots) are excluded (``do_not_specialize``), so the variants a server needs
are fixed by the model and the cache. A first compilation takes seconds, so
a request that brought the first tree would stall for it, outside vLLM's
warm-up. This launches both kernels on the engine's own cache, with the
shapes and strides of the runner's real calls, with and without split KV,
and the KV move (``python -m vllm_specplug.kernels.check`` counts, on a GPU,
that serving-shaped steps after it compile nothing new). Nothing is written:
tree attention reads only, and a KV move whose source is its destination
skips the copy.
"""

from __future__ import annotations

import torch

from vllm_specplug.kernels.cache_layout import gpu_split_cache


def warm_up_gpu_kernels(kv_cache: torch.Tensor, head_size: int, num_q_heads: int,
                        scale: float, table_width: int, dtype: torch.dtype) -> None:
    """Launch tree attention and the KV move once per specialization on
    ``kv_cache`` (one layer's cache, ``[blocks, kv_heads, block_size,
    2*head]``). ``table_width``: columns of vLLM's block table (its row
    stride, which the kernel takes as an argument)."""
    from vllm_specplug.kernels.kv_move import kv_move_triton
    from vllm_specplug.kernels.tree_attention import tree_attention_triton, tree_mask_from_parents

    dev = kv_cache.device
    k_cache, v_cache = gpu_split_cache(kv_cache, head_size)
    for num_seqs in (1, 2):
        nodes = 2 * num_seqs  # a root's child and grandchild per sequence
        q = torch.zeros(nodes, num_q_heads, head_size, dtype=dtype, device=dev)
        table = torch.zeros(num_seqs, table_width, dtype=torch.int32, device=dev)
        seq_lens = torch.full((num_seqs,), 3, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, nodes + 1, 2, dtype=torch.int32, device=dev)
        mask = tree_mask_from_parents([-1, 0]).repeat(num_seqs).to(dev)
        for segments in (1, 2):  # every split count shares one specialization
            tree_attention_triton(q, k_cache, v_cache, table, seq_lens, qsl, scale,
                                  tree_mask=mask, num_segments=segments)
        same = torch.zeros(num_seqs, dtype=torch.long, device=dev)
        kv_move_triton(k_cache, v_cache, same, same)  # the all-layers kernel, K and V at once
