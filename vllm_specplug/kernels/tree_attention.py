"""Tree attention over vLLM's paged KV cache (speculative-decoding verification).

Layouts
-------
q                [num_tokens, num_q_heads, head_dim]  varlen batch; sequence s owns
                 rows ``query_start_loc[s]:query_start_loc[s+1]`` (q_len_s rows).
k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]  vLLM flash-attn
                 layout, any strides (e.g. vLLM 0.32's K and V views of a layer
                 cache ``[blocks, kv_heads, block_size, 2*head]``:
                 ``transpose(1, 2).split(head_dim, -1)``).  The K/V of this step's
                 query tokens must ALREADY be written to the cache.
block_table      [num_seqs, max_blocks] int32, logical block -> physical block.
seq_lens         [num_seqs] int, keys per sequence INCLUDING the q_len_s new ones.
query_start_loc  [num_seqs + 1] int, cumulative query lengths.
tree_mask        [num_tokens] int64 or None (see below).
is_tree          [num_seqs] bool/int or None.
out              [num_tokens, num_q_heads, head_dim], dtype of q.

Visibility
----------
With ``ctx_len = seq_len - q_len``, the last q_len keys of a sequence are its
query tokens, in query order.  Query i (0-based inside its sequence) sees
  * every context key (position < ctx_len), and
  * new key j (position ctx_len + j) iff j <= i and
      - causal sequence: always (plain lower-triangular mask);
      - tree sequence:   bit j of ``tree_mask[query_start_loc[s] + i]`` is set.
Tree nodes must therefore be in topological order (ancestors before
descendants, which every draft-tree builder produces); bits above the diagonal
are ignored, which lets a tree sequence be bounded exactly like a causal one.
A sequence is a tree iff ``is_tree[s]`` is nonzero; ``is_tree=None`` means all
sequences are trees when ``tree_mask`` is given, and ``tree_mask=None`` means
all sequences are causal.  Tree sequences hold at most 64 query tokens (keys
with j >= 64 are invisible to them); causal sequences have no length limit.
GQA: query head h reads kv head ``h // (num_q_heads // num_kv_heads)``.
A query row with no visible key (only possible with ctx_len == 0 and an empty
mask row) yields zeros.

Why one int64 ancestor bitmask per query token
----------------------------------------------
A draft tree for verification has <= 64 nodes, so a query's whole mask row fits
in one register.  A program loads its rows' masks once (8 bytes per query,
coalesced) and tests a key with a shift and an AND, with no per-key memory
traffic and no per-sequence offset table.  A packed bool mask would cost q_len
bytes per row, loaded per KV tile with a 2-D gather, plus an offsets array.
The bitmask tensor is also fixed-size (num_tokens) and position-independent,
so it can live in a persistent CUDA-graph buffer.  Long causal prefills don't
need a mask at all, hence the per-sequence ``is_tree`` flag instead of a mask.

Kernel shape
------------
One program = BLOCK_Q query tokens of one sequence x all q heads of one kv head
(rows of the tile are (token, head) pairs), so each K/V tile is loaded once per
GQA group.  Programs are indexed by a flat q-block id and find their sequence by
binary search over ``query_start_loc`` (as vLLM's unified Triton attention does),
so the grid depends only on num_tokens/num_seqs: no host sync, CUDA-graph safe.
KV is walked in BLOCK_N-key tiles with an online softmax, first over the
context (no mask math) and then over the new tokens (tree/causal mask).

Split KV (segmented softmax)
----------------------------
A verification step has few query rows (a few requests x tens of nodes), so
at small batch the grid above has too few programs to fill a GPU while each
walks a long context alone. With ``num_segments`` S > 1 (the caller picks S
from host-known lengths: ``split_kv_segments``) each program walks one of S
slices of its sequence's context (the last slice also takes the new tokens)
and writes its unnormalised partial output with its running max and sum; a
second kernel merges the S partials of each row (the same log-sum-exp merge
as vLLM's segmented decode attention). S = 1 writes the output directly.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from . import use_triton

MAX_TREE_TOKENS = 64
MAX_BIT = tl.constexpr(MAX_TREE_TOKENS - 1)
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------
# mask helpers
# ----------------------------------------------------------------------------


def tree_mask_from_parents(parents: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
    """Ancestor bitmasks ``[n] int64`` for a tree given as a parent array.

    ``parents[i]`` is the index of node i's parent (< i) or -1 for a root.
    Bit j of the result's entry i is set iff j == i or j is an ancestor of i.
    """
    parents = [int(p) for p in (parents.tolist() if torch.is_tensor(parents) else parents)]
    n = len(parents)
    if n > MAX_TREE_TOKENS:
        raise ValueError(f"tree has {n} nodes, at most {MAX_TREE_TOKENS} fit in an int64 mask")
    masks = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}]={p}: nodes must be in topological order")
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    # Python ints are unbounded; fold bit 63 into int64's sign bit.
    return torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64)


def pack_tree_mask(dense: torch.Tensor) -> torch.Tensor:
    """Pack a dense ``[n, n]`` bool mask (row = query, col = key) into ``[n] int64``."""
    n = dense.shape[-1]
    if n > MAX_TREE_TOKENS:
        raise ValueError(f"{n} tree tokens, at most {MAX_TREE_TOKENS} supported")
    weights = torch.ones(n, dtype=torch.int64, device=dense.device) << torch.arange(
        n, device=dense.device
    )
    # Distinct powers of two: the sum is the OR (and wraps correctly into bit 63).
    return (dense.to(torch.int64) * weights).sum(-1)


# ----------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning flat q-block ``q_block``.

    Sequence s owns q-blocks starting at qsl[s] // BLOCK_Q + s: a safe upper
    bound on each sequence's block count that needs no per-step host data.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q,
    k_ptr, v_ptr, bt_row_ptr,
    pos, key_ok, visible, offs_d, d_ok, kv_head,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    scale_log2, BLOCK_SIZE,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over the keys at positions ``pos`` [BLOCK_N].

    ``key_ok`` [BLOCK_N] guards the loads, ``visible`` [BLOCK_M, BLOCK_N] the scores.
    """
    # Per-key physical block lookup: any block_size works and tiles needn't
    # align with cache blocks (the new-token loop starts mid-block).
    phys = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot_off = (pos % BLOCK_SIZE).to(tl.int64)
    k_t = tl.load(
        k_ptr + phys[None, :] * stride_kb + slot_off[None, :] * stride_kt
        + kv_head * stride_kh + offs_d[:, None] * stride_kd,
        mask=key_ok[None, :] & d_ok[:, None], other=0.0,
    )
    v = tl.load(
        v_ptr + phys[:, None] * stride_vb + slot_off[:, None] * stride_vt
        + kv_head * stride_vh + offs_d[None, :] * stride_vd,
        mask=key_ok[:, None] & d_ok[None, :], other=0.0,
    )
    s = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen nothing yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# Counts that change every step are not specialized on (Triton otherwise
# compiles a variant per "equals 1" and "divisible by 16"): a step with a new
# count would stall for a compile mid-serving, after the warm-up.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_segments"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    block_table_ptr, seq_lens_ptr, qsl_ptr, tree_mask_ptr, is_tree_ptr,
    part_ptr, ml_ptr,
    num_seqs, scale_log2, BLOCK_SIZE, num_tokens, num_segments,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    SPLIT: tl.constexpr,  # num_segments > 1: write partials to part/ml
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QPK: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # pow2 >= BLOCK_Q * QPK (tile rows)
    BLOCK_N: tl.constexpr,  # keys per tile
    HAS_TREE: tl.constexpr,
    ALL_TREE: tl.constexpr,  # is_tree omitted: every sequence is a tree
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block_local * BLOCK_Q + offs_m // QPK  # query index inside the sequence
    head = kv_head * QPK + offs_m % QPK
    row_ok = (offs_m < BLOCK_Q * QPK) & (q_idx < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )

    if HAS_TREE:
        bits = tl.load(tree_mask_ptr + q_tok, mask=row_ok, other=0)
        j_max = MAX_BIT
        if not ALL_TREE:
            # A causal row is a tree row with every bit set and no 64-key limit.
            seq_is_tree = tl.load(is_tree_ptr + seq) != 0
            bits = tl.where(seq_is_tree, bits, -1)
            j_max = tl.where(seq_is_tree, MAX_BIT, 0x7FFFFFFF)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)

    # This program's slice of the context (all of it unless SPLIT); the
    # last slice's program also walks the new tokens.
    ctx_lo = 0
    ctx_hi = ctx_len
    new_hi = ctx_len + tl.minimum(q_len, (q_block_local + 1) * BLOCK_Q)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(ctx_len, num_segments), BLOCK_N) * BLOCK_N
        ctx_lo = tl.minimum(segment * chunk, ctx_len)
        ctx_hi = tl.minimum(ctx_lo + chunk, ctx_len)
        new_hi = tl.where(segment == num_segments - 1, new_hi, ctx_len)

    # Context: visible to every query, only bounds to check.
    for start in range(ctx_lo, ctx_hi, BLOCK_N):
        pos = start + offs_n
        key_ok = pos < ctx_hi
        visible = row_ok[:, None] & key_ok[None, :]
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, pos, key_ok, visible, offs_d, d_ok, kv_head,
            stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd,
            scale_log2, BLOCK_SIZE, PRECISION,
        )

    # New tokens: j <= i bounds both causal and tree rows, so new_hi stops
    # at this block's last query instead of seq_len.
    for start in range(ctx_len, new_hi, BLOCK_N):
        pos = start + offs_n
        key_ok = pos < new_hi
        j = pos - ctx_len
        visible = row_ok[:, None] & key_ok[None, :] & (j[None, :] <= q_idx[:, None])
        if HAS_TREE:
            # Clamp the shift: shifting an int64 by >= 64 is undefined.
            bit = (bits[:, None] >> tl.minimum(j, MAX_BIT)[None, :].to(tl.int64)) & 1
            visible = visible & (bit != 0) & (j <= j_max)[None, :]
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, pos, key_ok, visible, offs_d, d_ok, kv_head,
            stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd,
            scale_log2, BLOCK_SIZE, PRECISION,
        )

    if SPLIT:
        # partials [segments, num_tokens, heads, HEAD_DIM], (max, sum) pairs
        # [segments, num_tokens, heads, 2]; merged by _merge_segments_kernel
        part_row = (segment * num_tokens + q_tok) * NUM_Q_HEADS + head
        tl.store(part_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            o_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_segments"])
def _merge_segments_kernel(
    part_ptr, ml_ptr, o_ptr, qsl_ptr,
    num_seqs, num_tokens, num_segments,
    stride_ot, stride_oh, stride_od,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # pow2 >= num_segments (MAX_SEGMENTS)
):
    """One (token, head) row: the log-sum-exp merge of its segments' partials."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_seqs):
        return  # padding rows stay unwritten, as without a split
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_segments
    part_row = (offs_s * num_tokens + tok) * NUM_Q_HEADS + head
    m = tl.load(ml_ptr + part_row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_ptr + part_row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # exp2(-inf) = 0
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.load(part_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=d_ok)


MAX_SEGMENTS = 8
"""Most context slices of a split-KV launch (the merge kernel's tile)."""


def split_kv_segments(max_context_len: int, num_programs: int, target_programs: int = 256,
                      min_keys: int = 512, max_segments: int = MAX_SEGMENTS) -> int:
    """Context slices per program for a launch of ``num_programs`` programs
    (q-blocks x kv heads) whose longest context is ``max_context_len`` keys
    (host-known: no sync): enough to bring the grid near ``target_programs``,
    each slice at least ``min_keys`` long; 1 (no split) for short contexts
    or a grid already full."""
    if num_programs >= target_programs or max_context_len < 2 * min_keys:
        return 1
    want = -(-target_programs // max(num_programs, 1))
    return max(1, min(want, max_context_len // min_keys, max_segments))


def tile_rows(block_d: int) -> int:
    """Tile rows ((token, head) pairs) per program. A program reads its
    sequence's whole context once, so more query tokens per program means
    fewer reads of the same K/V: 64 rows ran 1.0-2.7x faster than 16 on an
    H200 across batch shapes (``benchmarks/studies/gpu_tree_tiles.py``);
    head sizes above 128 get 32 to keep the tile in registers."""
    return 64 if block_d <= 128 else 32


def tile_keys(block_d: int, element_size: int) -> int:
    """Keys per tile: 64 where a key row is at most 256 bytes (bf16/fp16 up
    to head size 128, fp32 up to 64), else 32 (shared memory per stage)."""
    return 64 if block_d * element_size <= 256 else 32


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    tree_mask: Optional[torch.Tensor] = None,
    is_tree: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    block_n: Optional[int] = None,
    num_segments: Optional[int] = 1,
    max_context_len: int = 0,
    block_q: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """Launch the tree-attention kernel; see the module docstring for layouts.

    Output rows past ``query_start_loc[-1]`` (padding) are left unwritten.
    ``block_n`` is the number of keys per tile (a power of two; None:
    ``tile_keys``);
    ``num_segments`` the context slices per sequence (split KV), None: by
    ``split_kv_segments`` from ``max_context_len``, the longest
    ``seq_len - q_len`` (known on the host: no sync). ``block_q``: query
    tokens per program (None: enough for ``tile_rows`` rows); ``num_warps``:
    Triton's (None: its default).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads is not a multiple of {num_kv_heads} kv heads")
    if tree_mask is not None and tree_mask.dtype != torch.int64:
        raise TypeError("tree_mask must be int64 ancestor bitmasks")
    num_seqs = seq_lens.shape[0]
    qpk = num_q_heads // num_kv_heads
    # enough query tokens per program for tile_rows rows; tl.dot wants at
    # least 16 rows on GPU
    block_d = triton.next_power_of_2(head_dim)
    if block_q is None:
        block_q = max(1, tile_rows(block_d) // qpk)
    block_m = max(16, triton.next_power_of_2(block_q * qpk))
    if block_n is None:
        block_n = tile_keys(block_d, q.element_size())
    if out is None:
        out = torch.empty_like(q)
    # Enough q-blocks for any split of num_tokens among num_seqs sequences.
    q_blocks = num_tokens // block_q + num_seqs
    if num_segments is None:
        num_segments = split_kv_segments(max_context_len, q_blocks * num_kv_heads)
    if not 1 <= num_segments <= MAX_SEGMENTS:
        raise ValueError(f"num_segments {num_segments}: 1 to {MAX_SEGMENTS}")
    split = num_segments > 1
    grid = (q_blocks, num_kv_heads, num_segments)
    has_tree = tree_mask is not None
    dummy = seq_lens  # never read when the matching constexpr flag is off
    part = ml = dummy
    if split:
        part = torch.empty((num_segments, num_tokens, num_q_heads, head_dim),
                           dtype=torch.float32, device=q.device)
        ml = torch.empty((num_segments, num_tokens, num_q_heads, 2),
                         dtype=torch.float32, device=q.device)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_table, seq_lens, query_start_loc,
        tree_mask if has_tree else dummy,
        is_tree if is_tree is not None else dummy,
        part, ml,
        num_seqs, scale * _LOG2E, block_size, num_tokens, num_segments,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        block_table.stride(0),
        NUM_Q_HEADS=num_q_heads,
        SPLIT=split,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        QPK=qpk,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_TREE=has_tree,
        ALL_TREE=is_tree is None,
        # fp32 callers want fp32 accuracy; TF32 would miss a 1e-4 tolerance.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **({} if num_warps is None else {"num_warps": num_warps}),
    )
    if split:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            part, ml, out, query_start_loc, num_seqs, num_tokens, num_segments,
            *out.stride(), NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=MAX_SEGMENTS,  # one specialization, compiled at warm-up
        )
    return out


# ----------------------------------------------------------------------------
# torch reference / CPU fallback
# ----------------------------------------------------------------------------


def dense_visibility(
    seq_len: int, q_len: int, bits: Optional[torch.Tensor], device=None
) -> torch.Tensor:
    """Explicit ``[q_len, seq_len]`` bool mask of one sequence (bits=None: causal)."""
    ctx_len = seq_len - q_len
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(q_len, device=device)[None, :]
    new = j <= i
    if bits is not None:
        shift = j.clamp(max=MAX_TREE_TOKENS - 1).expand(q_len, q_len)
        tree = ((bits.to(torch.int64)[:, None] >> shift) & 1).bool() & (j < MAX_TREE_TOKENS)
        new = new & tree
    ctx = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device)
    return torch.cat([ctx, new], dim=1)


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    tree_mask: Optional[torch.Tensor] = None,
    is_tree: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    block_n: Optional[int] = None,
    num_segments: Optional[int] = 1,
    max_context_len: int = 0,
    block_q: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """Dense per-sequence attention with an explicit mask; same contract as the kernel.

    The launch's tuning arguments are accepted (and ignored) so both
    functions share a signature.
    """
    del block_n, num_segments, max_context_len, block_q, num_warps
    num_q_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qpk = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    flags = is_tree.tolist() if is_tree is not None else [True] * len(lens)
    for s, seq_len in enumerate(lens):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_table[s, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(qpk, dim=1)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(qpk, dim=1)
        bits = tree_mask[q0:q1] if tree_mask is not None and flags[s] else None
        visible = dense_visibility(seq_len, q1 - q0, bits, q.device)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> 0
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def tree_attention(*args, **kwargs) -> torch.Tensor:
    """Triton kernel when it can run on the inputs, torch reference otherwise."""
    q = args[0] if args else kwargs["q"]
    if use_triton(_tree_attention_kernel, q):
        return tree_attention_triton(*args, **kwargs)
    return tree_attention_ref(*args, **kwargs)
