"""The layouts of vLLM's paged KV cache that the tree attention reads and
``kv_move`` writes: views of one layer's cache tensor, no copies.

Shared by the runner (``runner/tree_attention.py``) and the CPU kernel
(``kernels/cpu_tree_attention.py``), so neither imports the other for them.
"""

from __future__ import annotations

import torch


def cpu_split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, kv_heads, block_size, 2*head]`` viewed as
    key and value caches ``[blocks, kv_heads, block_size, head]`` (the same
    view ``CPUAttentionBackendImpl`` takes)."""
    nb, kvh, bs, two_d = kv_cache.shape
    kv = kv_cache.view(nb, kvh, bs * 2, two_d // 2)
    return kv[:, :, :bs], kv[:, :, bs:]


def gpu_split_cache(kv_cache: torch.Tensor, head_size: int):
    """FLASH_ATTN's and TRITON_ATTN's own split of a layer cache
    ``[blocks, kv_heads, block_size, 2*head]`` into K and V views
    ``[blocks, block_size, kv_heads, head]`` (``flash_attn.py``
    ``do_kv_cache_update``/``forward``, ``triton_attn.py`` likewise)."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def slot_views(kv_cache: torch.Tensor, head_size: int, layout: str):
    """K and V of one layer as ``[blocks, block_size, kv_heads, head]`` views
    of the cache's own memory (what ``kv_move`` moves slots in).

    ``layout``: ``"gpu"`` (FLASH_ATTN/TRITON_ATTN), or one of
    ``CPU_KV_LAYOUTS`` for vLLM's CPU backend.
    """
    if layout == "gpu":
        return gpu_split_cache(kv_cache, head_size)
    k, v = cpu_split_cache(kv_cache)
    v = v.permute(0, 2, 1, 3)
    if layout == "k_transposed":
        # A key block is stored [kv_heads, head, block_size]: token t, dim e of
        # head h at h*head*bs + e*bs + t inside the block.
        nb, kvh, bs, d = k.shape
        k = torch.as_strided(k, (nb, bs, kvh, d), (k.stride(0), 1, k.stride(1), bs),
                             k.storage_offset())
    else:
        k = k.permute(0, 2, 1, 3)
    return k, v


# In-block layouts of vLLM's CPU cache seen per ISA path. "k_transposed"
# (the vec/vec16 paths) stores a key block as [kv_heads, head, block_size] and a
# value block as [kv_heads, block_size, head]. The runner picks the one that
# survives a round trip through the backend's writer at start-up.
CPU_KV_LAYOUTS = ("k_transposed", "plain")
