"""Move the accepted draft path's K/V into the slots of consecutive positions.

After tree verification the accepted tokens sit at scattered tree slots; the
next step expects them at positions ctx_len, ctx_len+1, ...  This copies
``slot src_slots[i] -> slot dst_slots[i]`` for K and V.

Layouts
-------
k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]   one layer, or
                  [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
                  stacked; any strides, so the K and V views vLLM 0.32's
                  FLASH_ATTN/TRITON_ATTN take of a layer cache
                  ``[blocks, kv_heads, block_size, 2*head]``
                  (``transpose(1, 2).split(head, -1)``) work in every layout.
                  A list/tuple of per-layer caches is also accepted.
                  ``v_cache`` may be None (single-cache layouts).
src_slots, dst_slots  [n] int64, slot = block_id * block_size + offset.

Guarantee
---------
The result is as if ALL sources were read before ANY destination is written:
``new[dst[i]] = old[src[i]]`` for every i, whatever the overlap between the two
slot sets (shifts up or down, chains, swaps, cycles).  Entries with
``src == dst`` or a negative slot are skipped, so fixed-size (CUDA-graph)
buffers can be padded with -1.  Destinations must be distinct; sources may repeat.

Why two launches
----------------
Programs of one launch run in no defined order, so a single kernel could read
a source slot after another program overwrote it.  The first launch gathers
the sources into a scratch buffer, the second scatters it: the launch boundary
is the global barrier.  n is the number of accepted tokens (tens), so the
scratch round trip costs far less than the second launch itself.  K and V,
and every layer given, share one launch pair where they share a shape,
strides and dtype (as the K and V views of one cache do); otherwise each
cache gets a pair.

Every layer in one launch pair
------------------------------
vLLM allocates each layer's cache on its own, so no one tensor spans the
layers. ``kv_move_caches`` takes the K and V views of every layer (same
shape, strides and dtype: one model's layers) and moves them all in one
gather and one scatter launch: each program reads its cache's address from
a table of base addresses (``cache_table``), as vLLM's own ``copy_blocks``
kernel does. Build the table once (the caches do not move) and pass it on.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from . import use_triton

Cache = Union[torch.Tensor, Sequence[torch.Tensor]]


@triton.jit
def _slot_row(slot, BLOCK_SIZE, stride_b, stride_t):
    """Element offset of ``slot`` in a cache with the given strides."""
    return (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_t


# ``n`` (slots moved) changes every step: not specialized on, so no step
# compiles a new variant after the warm-up.
@triton.jit(do_not_specialize=["n"])
def _kv_gather_kernel(
    table_ptr, scratch_ptr, src_ptr, dst_ptr,
    n, BLOCK_SIZE, num_feat,
    stride_b, stride_t, stride_h, stride_d,
    DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """scratch[c, i, f] = caches[c][src[i], f] for non-skipped entries;
    cache c's first element at address ``table[c]``."""
    i = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    offs_f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if (src == dst) | (src < 0) | (dst < 0):
        return
    base = tl.load(table_ptr + c).to(tl.pointer_type(DTYPE))
    mask = offs_f < num_feat
    feat = (offs_f // HEAD_DIM) * stride_h + (offs_f % HEAD_DIM) * stride_d
    row = _slot_row(src, BLOCK_SIZE, stride_b, stride_t)
    vals = tl.load(base + row + feat, mask=mask)
    tl.store(scratch_ptr + (c * n + i) * num_feat + offs_f, vals, mask=mask)


@triton.jit(do_not_specialize=["n"])
def _kv_scatter_kernel(
    table_ptr, scratch_ptr, src_ptr, dst_ptr,
    n, BLOCK_SIZE, num_feat,
    stride_b, stride_t, stride_h, stride_d,
    DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """caches[c][dst[i], f] = scratch[c, i, f] for non-skipped entries."""
    i = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    offs_f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if (src == dst) | (src < 0) | (dst < 0):
        return
    base = tl.load(table_ptr + c).to(tl.pointer_type(DTYPE))
    mask = offs_f < num_feat
    feat = (offs_f // HEAD_DIM) * stride_h + (offs_f % HEAD_DIM) * stride_d
    row = _slot_row(dst, BLOCK_SIZE, stride_b, stride_t)
    vals = tl.load(scratch_ptr + (c * n + i) * num_feat + offs_f, mask=mask)
    tl.store(base + row + feat, vals, mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16, torch.int8: tl.int8, torch.uint8: tl.uint8,
              torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


def cache_table(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The base-address table of ``caches`` (4-D slot views
    ``[blocks, block_size, kv_heads, head]``, one shape, strides, dtype and
    device) for :func:`kv_move_caches`; raises ValueError where they differ."""
    first = caches[0]
    for c in caches:
        if (c.dim() != 4 or c.shape != first.shape or c.stride() != first.stride()
                or c.dtype != first.dtype or c.device != first.device):
            raise ValueError("kv_move_caches needs caches of one shape, strides, dtype "
                             "and device")
    if first.dtype not in _TL_DTYPES:
        raise ValueError(f"kv_move_caches: unsupported dtype {first.dtype}")
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(first.device)


def kv_move_caches(caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                   dst_slots: torch.Tensor, table: Optional[torch.Tensor] = None) -> None:
    """In-place ``cache[dst_slots[i]] = cache[src_slots[i]]`` in every one of
    ``caches`` (see :func:`cache_table`), in one gather and one scatter
    launch whatever their number; ``table``: their ``cache_table``."""
    _check_slots(src_slots, dst_slots)
    if src_slots.numel() == 0 or not caches:
        return
    if table is None:
        table = cache_table(caches)
    first = caches[0]
    _, block_size, num_heads, head_dim = first.shape
    n, num_feat = src_slots.shape[0], num_heads * head_dim
    block_f = min(triton.next_power_of_2(num_feat), 1024)
    scratch = torch.empty((len(caches), n, num_feat), dtype=first.dtype, device=first.device)
    grid = (n, len(caches), triton.cdiv(num_feat, block_f))
    args = (table, scratch, src_slots, dst_slots, n, block_size, num_feat, *first.stride())
    meta = dict(DTYPE=_TL_DTYPES[first.dtype], HEAD_DIM=head_dim, BLOCK_F=block_f)
    _kv_gather_kernel[grid](*args, **meta)
    _kv_scatter_kernel[grid](*args, **meta)


def _as_layers(cache: torch.Tensor) -> torch.Tensor:
    if cache.dim() == 4:
        return cache.unsqueeze(0)  # a view: writes still land in the caller's tensor
    if cache.dim() == 5:
        return cache
    raise ValueError(f"expected a 4-D or 5-D cache, got shape {tuple(cache.shape)}")


def _move_one(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """One 4-D cache, or every layer of a stacked 5-D one, in one launch pair."""
    kv_move_caches(list(_as_layers(cache).unbind(0)), src, dst)


def _cache_list(k_cache: Cache, v_cache: Optional[Cache]) -> list[torch.Tensor]:
    """K's caches then V's (each a cache or a sequence of them)."""
    caches = list(k_cache) if isinstance(k_cache, (list, tuple)) else [k_cache]
    if v_cache is not None:
        caches += list(v_cache) if isinstance(v_cache, (list, tuple)) else [v_cache]
    return caches


def _check_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError("src_slots and dst_slots must be 1-D and of equal length")


def kv_move_triton(
    k_cache: Cache, v_cache: Optional[Cache], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """In-place ``cache[dst_slots[i]] = cache[src_slots[i]]`` for K and V (see module doc)."""
    _check_slots(src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    layers = [layer for cache in _cache_list(k_cache, v_cache)
              for layer in _as_layers(cache).unbind(0)]
    try:
        table = cache_table(layers)
    except ValueError:  # K and V (or the layers) differ in shape or strides
        for cache in _cache_list(k_cache, v_cache):
            _move_one(cache, src_slots, dst_slots)
        return
    kv_move_caches(layers, src_slots, dst_slots, table)


def kv_move_ref(
    k_cache: Cache, v_cache: Optional[Cache], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Torch version of :func:`kv_move_triton` (advanced indexing gathers a copy first)."""
    _check_slots(src_slots, dst_slots)
    keep = (src_slots != dst_slots) & (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[keep], dst_slots[keep]
    caches = _cache_list(k_cache, v_cache)
    for cache in caches:
        cache5 = _as_layers(cache)
        bs = cache5.shape[2]
        cache5[:, dst // bs, dst % bs] = cache5[:, src // bs, src % bs]


def kv_move(
    k_cache: Cache, v_cache: Optional[Cache], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Triton kernel when it can run on the inputs, torch reference otherwise."""
    first = k_cache[0] if isinstance(k_cache, (list, tuple)) else k_cache
    # the kernels load and store through a typed table (``_TL_DTYPES``)
    if first.dtype in _TL_DTYPES and use_triton(_kv_gather_kernel, first, src_slots):
        kv_move_triton(k_cache, v_cache, src_slots, dst_slots)
    else:
        kv_move_ref(k_cache, v_cache, src_slots, dst_slots)
