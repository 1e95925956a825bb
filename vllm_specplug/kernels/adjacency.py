"""Token adjacency table (Token Recycling / Graft style drafting).

Layouts
-------
table      [vocab_size, k] int32   row v = the top-k likely successors of token v.
           Entries outside [0, vocab_size) (e.g. -1 = "unknown") are allowed.
tokens     [n] int      tokens whose rows are refreshed; entries outside
           [0, vocab_size) are skipped, so -1 can pad fixed-size buffers.
topk_ids   [n, k] int   new successors for tokens[i] (e.g. ``logits.topk(k).indices``).
roots      [B] int      one root token per draft tree.
parent_idx [T] int32    static tree template: node t's parent node, -1 = the root.
rank       [T] int32    node t is its parent's rank[t]-th successor.
out        [B, T]       dtype of roots; out[b, t] = table[parent_token, rank[t]].

Semantics
---------
update:  ``table[tokens[i]] = topk_ids[i]``; if a token repeats, its LAST
         occurrence wins, so the result is deterministic.
expand:  parent_token = roots[b] if parent_idx[t] == -1 else out[b, parent_idx[t]];
         an out-of-range parent token or rank yields -1 (and -1 propagates).

Kernel notes
------------
Update: programs own blocks of entries and drop an entry if a later one has
the same token (a blocked O(n^2) compare on tokens that stay in L2).  The
survivors have distinct tokens, so the row writes cannot race.  n is the
number of tokens verified in a step (hundreds); the alternative, atomics on a
vocab-sized "last index" scratch, needs a memset of that scratch every call.

Expand: one program per tree (batch row) keeps the row's T node tokens in
registers and recomputes all nodes from their parents ``depth`` times (a Jacobi
sweep): after sweep d every node at depth <= d is final.  That costs ``depth``
dependent table loads instead of T for a node-by-node walk, needs no level
array, and reads parents from registers (``tl.gather``) rather than from
memory written by other threads of the program.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from . import use_triton

# ----------------------------------------------------------------------------
# (a) table update
# ----------------------------------------------------------------------------


@triton.jit
def _adjacency_update_kernel(
    table_ptr, tokens_ptr, topk_ptr,
    n, vocab_size, k,
    stride_tv, stride_tk, stride_pn, stride_pk,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    tok_i = tl.load(tokens_ptr + offs_i, mask=offs_i < n, other=-1).to(tl.int64)
    keep = (offs_i < n) & (tok_i >= 0) & (tok_i < vocab_size)

    # Only later entries can override, and they all lie at or after this block.
    for j0 in range(tl.program_id(0) * BLOCK_I, n, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        tok_j = tl.load(tokens_ptr + offs_j, mask=offs_j < n, other=-1).to(tl.int64)
        later_same = (tok_i[:, None] == tok_j[None, :]) & (offs_j[None, :] > offs_i[:, None])
        later_same = later_same & (offs_j < n)[None, :]
        keep = keep & (tl.max(later_same.to(tl.int32), axis=1) == 0)

    offs_k = tl.arange(0, BLOCK_K)
    mask = keep[:, None] & (offs_k < k)[None, :]
    rows = tl.load(
        topk_ptr + offs_i.to(tl.int64)[:, None] * stride_pn + offs_k[None, :] * stride_pk, mask=mask
    )
    tl.store(
        table_ptr + tok_i[:, None] * stride_tv + offs_k[None, :] * stride_tk,
        rows.to(table_ptr.dtype.element_ty),
        mask=mask,
    )


def _check_update(table: torch.Tensor, tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
    if tokens.dim() != 1 or topk_ids.shape != (tokens.shape[0], table.shape[1]):
        raise ValueError(
            f"expected tokens [n] and topk_ids [n, {table.shape[1]}], "
            f"got {tuple(tokens.shape)} and {tuple(topk_ids.shape)}"
        )


def adjacency_update_triton(table: torch.Tensor, tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """In-place ``table[tokens[i]] = topk_ids[i]``, last duplicate wins."""
    _check_update(table, tokens, topk_ids)
    n = tokens.shape[0]
    if n == 0:
        return
    block_i = 64
    _adjacency_update_kernel[(triton.cdiv(n, block_i),)](
        table, tokens, topk_ids,
        n, table.shape[0], table.shape[1],
        *table.stride(), *topk_ids.stride(),
        BLOCK_I=block_i,
        BLOCK_J=128,
        BLOCK_K=triton.next_power_of_2(table.shape[1]),
    )


def adjacency_update_ref(table: torch.Tensor, tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Torch version of :func:`adjacency_update_triton`."""
    _check_update(table, tokens, topk_ids)
    vocab_size = table.shape[0]
    idx = torch.arange(tokens.shape[0], device=tokens.device)
    valid = (tokens >= 0) & (tokens < vocab_size)
    tok, idx = tokens[valid].long(), idx[valid]
    # index_put with duplicate indices has no defined winner; pick it explicitly.
    last = torch.full((vocab_size,), -1, dtype=idx.dtype, device=idx.device)
    last.scatter_reduce_(0, tok, idx, reduce="amax")
    win = idx[last[tok] == idx]
    table[tokens[win].long()] = topk_ids[win].to(table.dtype)


def adjacency_update(table: torch.Tensor, tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Triton kernel when it can run on the inputs, torch reference otherwise."""
    if use_triton(_adjacency_update_kernel, table, tokens, topk_ids):
        adjacency_update_triton(table, tokens, topk_ids)
    else:
        adjacency_update_ref(table, tokens, topk_ids)


# ----------------------------------------------------------------------------
# (b) static tree template expansion
# ----------------------------------------------------------------------------


def template_depth(parent_idx: Union[Sequence[int], torch.Tensor]) -> int:
    """Depth of a template (a node whose parent is the root has depth 1).

    Templates are static: compute this once and pass it to the expand call, as
    it reads ``parent_idx`` on the host.
    """
    parents = parent_idx.tolist() if torch.is_tensor(parent_idx) else list(parent_idx)
    depth = []
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"parent_idx[{t}]={p}: nodes must be in topological order")
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


@triton.jit
def _template_expand_kernel(
    table_ptr, roots_ptr, parent_ptr, rank_ptr, out_ptr,
    num_nodes, depth, vocab_size, k,
    stride_tv, stride_tk, stride_ob, stride_ot,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_nodes
    root = tl.load(roots_ptr + b).to(tl.int64)
    parent = tl.load(parent_ptr + offs_t, mask=t_ok, other=-1)
    rank = tl.load(rank_ptr + offs_t, mask=t_ok, other=0)
    from_root = parent < 0
    gather_idx = tl.where(from_root, 0, parent)
    load_ok = t_ok & (rank >= 0) & (rank < k)

    tokens = tl.full([BLOCK_T], -1, dtype=tl.int64)
    for _ in range(depth):
        parent_tok = tl.where(from_root, root, tl.gather(tokens, gather_idx, axis=0))
        ok = load_ok & (parent_tok >= 0) & (parent_tok < vocab_size)
        tokens = tl.load(
            table_ptr + parent_tok * stride_tv + rank * stride_tk, mask=ok, other=-1
        ).to(tl.int64)

    tl.store(out_ptr + b * stride_ob + offs_t * stride_ot, tokens, mask=t_ok)


def template_expand_triton(
    table: torch.Tensor,
    roots: torch.Tensor,
    parent_idx: torch.Tensor,
    rank: torch.Tensor,
    depth: Optional[int] = None,
) -> torch.Tensor:
    """Expand one template per root: returns ``[B, T]`` draft tokens (dtype of roots).

    ``depth`` = :func:`template_depth` (parent_idx); pass it to avoid a host read.
    """
    num_nodes = parent_idx.shape[0]
    if rank.shape != parent_idx.shape:
        raise ValueError("parent_idx and rank must have the same shape [T]")
    if depth is None:
        depth = template_depth(parent_idx)
    out = torch.empty((roots.shape[0], num_nodes), dtype=roots.dtype, device=roots.device)
    if out.numel() == 0:
        return out
    _template_expand_kernel[(roots.shape[0],)](
        table, roots, parent_idx, rank, out,
        num_nodes, depth, table.shape[0], table.shape[1],
        *table.stride(), *out.stride(),
        BLOCK_T=triton.next_power_of_2(num_nodes),
    )
    return out


def template_expand_ref(
    table: torch.Tensor,
    roots: torch.Tensor,
    parent_idx: torch.Tensor,
    rank: torch.Tensor,
    depth: Optional[int] = None,
) -> torch.Tensor:
    """Torch version of :func:`template_expand_triton` (node-by-node walk)."""
    del depth
    vocab_size, k = table.shape
    parents, ranks = parent_idx.tolist(), rank.tolist()
    out = torch.empty((roots.shape[0], len(parents)), dtype=roots.dtype, device=roots.device)
    for t, (p, r) in enumerate(zip(parents, ranks)):
        if not -1 <= p < t:
            raise ValueError(f"parent_idx[{t}]={p}: nodes must be in topological order")
        parent_tok = (roots if p < 0 else out[:, p]).long()
        ok = (parent_tok >= 0) & (parent_tok < vocab_size) & (0 <= r < k)
        child = table[parent_tok.clamp(0, vocab_size - 1), min(max(r, 0), k - 1)]
        out[:, t] = torch.where(ok, child.to(out.dtype), torch.full_like(out[:, t], -1))
    return out


def template_expand(
    table: torch.Tensor,
    roots: torch.Tensor,
    parent_idx: torch.Tensor,
    rank: torch.Tensor,
    depth: Optional[int] = None,
) -> torch.Tensor:
    """Triton kernel when it can run on the inputs, torch reference otherwise."""
    if use_triton(_template_expand_kernel, table, roots):
        return template_expand_triton(table, roots, parent_idx, rank, depth)
    return template_expand_ref(table, roots, parent_idx, rank, depth)
