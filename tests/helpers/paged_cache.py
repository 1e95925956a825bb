"""A vLLM CPU paged KV cache written by hand, for the attention tests."""

from __future__ import annotations

import torch


def paged_cache(k_ctx, v_ctx, blocks, nb, bs, layout):
    """A vLLM CPU cache ``[nb, Hkv, bs, 2D]`` holding the context at ``blocks``,
    written by hand in ``layout`` (k_transposed: a key block is [Hkv, D, bs]);
    unused slots hold NaN."""
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
