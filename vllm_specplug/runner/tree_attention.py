"""Tree attention for the verification rows, on top of vLLM's own backend.

vLLM's attention kernels are causal: node ``j`` of a draft tree would see
every node laid out before it, siblings included. We let the backend run as
usual (it is right for every row that is not a tree node: prefills, chains,
the tree's root) and then recompute the tree rows with a per-request
ancestor mask. vLLM 0.32 writes a step's K/V to the paged cache before the
attention forward (``unified_kv_cache_update``), so when the wrapper runs
every tree row's K/V already sits at its linear slot:

- CPU (``cpu_tree_rows``): context keys (positions before the root) are read
  from the paged cache block by block (``context_blocks``), in the layout
  checked once at start-up by a round trip through the backend's own writer
  (``read_context_kv``, built on the same reader); the step's own keys (root + nodes) come
  straight from the layer's inputs.
- GPU (``gpu_tree_rows``, FLASH_ATTN/TRITON_ATTN): the Triton tree kernel
  reads every key (context, root, nodes) from the cache, split exactly as the
  backends split it: ``kv_cache [blocks, kv_heads, block_size, 2*head]`` ->
  ``transpose(1, 2).split(head, -1)`` -> K and V ``[blocks, block_size,
  kv_heads, head]`` views (any physical stride order). On TRITON_ATTN the
  backend's call skips the nodes (``compact_triton_metadata``), as on CPU.

After acceptance the accepted path's K/V is moved to consecutive slots from
the cache's own slots (``move_accepted_kv``, the ``kv_move`` kernel on GPU):
nothing is copied out of the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vllm_specplug.engine.transfer import to_device, to_device_parts
from vllm_specplug.kernels.cache_layout import cpu_split_cache, gpu_split_cache, slot_views


@dataclass
class TreeRow:
    """One request whose draft is a real tree (not a chain) in this step."""

    row_start: int
    """Flat index of the root row (the last verified token) in the batch:
    vLLM's convention, the first of the request's last ``num_nodes + 1`` rows."""
    num_nodes: int
    """Tree nodes after the root (rows ``row_start+1 .. row_start+num_nodes``)."""
    context_len: int
    """Tokens already in the cache before the root (= the root's position)."""
    req_index: int
    """The request's batch row (its block-table row in the attention metadata)."""
    mask: torch.Tensor
    """``[num_nodes, num_nodes + 1]`` bool: node row -> visible step rows."""
    chain_prefix: int = 0
    """Leading nodes that form a chain from the root (node ``j``'s parent is
    node ``j - 1``). The backend's causal rows are already right for them:
    a causal row sees the context, the root and the nodes laid out before
    it, which for these are exactly its ancestors. The CPU path recomputes
    only the nodes after them (methods lay their best path out first)."""
    _bias: torch.Tensor | None = None
    _mask_u8: torch.Tensor | None = None

    def step_mask_u8(self) -> torch.Tensor:
        """``mask`` as contiguous bytes (the native kernel's form), built once
        per step for every layer."""
        if self._mask_u8 is None:
            self._mask_u8 = self.mask.to(torch.uint8).contiguous()
        return self._mask_u8

    def step_bias(self) -> torch.Tensor:
        """``mask`` as an additive float bias (0 / -inf), built once per step
        for every layer."""
        if self._bias is None:
            self._bias = torch.zeros(self.mask.shape, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._bias


@dataclass
class TreeStep:
    """What the attention wrapper needs for one forward pass (and what it
    leaves behind for the KV move)."""

    rows: list[TreeRow]
    caches: dict[str, tuple] = field(default_factory=dict)
    """layer name -> (layer, kv_cache): references, no copies."""
    slot_mapping: torch.Tensor | None = None
    """The step's slot per flat token row (source and target of the KV move)."""
    _gpu: dict | None = None
    """The GPU kernel's per-step inputs, built on the first layer, reused by
    the others (one host->device copy per step, not per layer)."""
    _compact: dict = field(default_factory=dict)
    """id(attention metadata) -> (metadata, its compacted copy or None): see
    ``compact_cpu_metadata`` and ``compact_triton_metadata``; built on the
    first layer, reused by the others."""
    query_start_loc: np.ndarray | None = None
    """The step's query start per request, on the host (vLLM's own copy):
    what ``compact_triton_metadata`` rebuilds the request boundaries from
    without reading the device."""
    native: dict = field(default_factory=dict)
    """CPU: (tree row, first recomputed node) -> (the native kernel's call as
    built on the step's first layer, its pointers' offsets from that layer's
    tensors): ``cpu_tree_rows`` re-points it at every next layer."""
    native_layout: tuple | None = None
    """The dtypes, cache shape and strides of the layer those calls were
    built on (``_native_layout``; a layer laid out otherwise builds its own)."""

    def compacted(self, meta, build):
        """``build()`` (the backend's metadata with the nodes taken out, or
        None) for this ``meta``, made once per step."""
        key = id(meta)
        hit = self._compact.get(key)
        if hit is None or hit[0] is not meta:
            hit = (meta, build())
            self._compact[key] = hit
        return hit[1]

    def gpu_inputs(self, device) -> dict:
        if self._gpu is None:
            from vllm_specplug.kernels.tree_attention import pack_tree_mask

            n = np.asarray([r.num_nodes for r in self.rows], dtype=np.int64)
            qsl = np.zeros(len(self.rows) + 1, dtype=np.int64)
            qsl[1:] = np.cumsum(n)
            rows = np.concatenate([np.arange(r.row_start + 1, r.row_start + 1 + r.num_nodes)
                                   for r in self.rows])
            masks = torch.cat([pack_tree_mask(r.mask[:, 1:].cpu()) for r in self.rows])
            seq_lens = [r.context_len + 1 + r.num_nodes for r in self.rows]
            req = [r.req_index for r in self.rows]
            rows_t, qsl_t, seq_t, mask_t, req_t = to_device_parts(
                [rows, qsl, seq_lens, masks.numpy(), req], device)
            self._gpu = dict(rows=rows_t, qsl=qsl_t.to(torch.int32),
                             seq_lens=seq_t.to(torch.int32), tree_mask=mask_t, req=req_t)
        return self._gpu


def context_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the cache blocks holding positions ``0 .. length-1``: keys
    as ``K^T [nblk, kv_heads, head, block_size]`` (a ``k_transposed`` key
    block already is ``K^T``), values ``[nblk, kv_heads, block_size, head]``.
    The one reader of the CPU cache: the tree rows use it every layer, and
    the runner's start-up round trip proves it (through ``read_context_kv``).
    """
    nblk = (length + k_cache.shape[2] - 1) // k_cache.shape[2]
    ids = block_ids[:nblk].long()
    kb = k_cache.index_select(0, ids)  # [nblk, kvh, bs, d] as stored
    if layout == "k_transposed":
        n, kvh, bs, d = kb.shape
        kt = kb.view(n, kvh, d, bs)  # the same bytes, read as [kvh, d, bs]
    else:
        kt = kb.transpose(2, 3)
    return kt, v_cache.index_select(0, ids)


def read_context_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
    layout: str = "k_transposed",
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``0 .. length-1``, each ``[length, kv_heads, head]``
    (``context_blocks`` laid out by position)."""
    kt, vb = context_blocks(*cpu_split_cache(kv_cache), block_ids, length, layout)
    n, kvh, d, bs = kt.shape
    k = kt.permute(0, 3, 1, 2).reshape(n * bs, kvh, d)[:length]
    v = vb.permute(0, 2, 1, 3).reshape(n * bs, kvh, d)[:length]
    return k, v


class TreeAttentionWrapper:
    """Wraps one attention layer's ``impl.forward`` (see module docstring)."""

    layout = "k_transposed"
    """CPU: set once by the runner's start-up round trip (see
    ``kernels.cache_layout.CPU_KV_LAYOUTS``)."""

    def __init__(self, layer_name: str, impl, get_step, gpu: bool | None = None) -> None:
        self.layer_name = layer_name
        self.impl = impl
        self.inner = impl.forward
        self.get_step = get_step
        self.gpu = gpu
        """GPU path (Triton kernel on the paged cache); None: by the cache's device."""

    def __call__(self, layer, query, key, value, kv_cache, attn_metadata,
                 output, *args, **kwargs):
        step: TreeStep | None = self.get_step()
        if step is None or attn_metadata is None or not step.rows:
            return self.inner(layer, query, key, value, kv_cache, attn_metadata,
                              output, *args, **kwargs)
        gpu = kv_cache.is_cuda if self.gpu is None else self.gpu
        # the backend skips the nodes recomputed below where it can
        if gpu:
            meta = step.compacted(attn_metadata, lambda: compact_triton_metadata(
                attn_metadata, step.rows, step.query_start_loc))
        else:
            meta = step.compacted(attn_metadata, lambda: compact_cpu_metadata(
                attn_metadata, step.rows, self.impl, getattr(layer, "isa", "vec"),
                query.dtype))
        meta = meta or attn_metadata
        out = self.inner(layer, query, key, value, kv_cache, meta, output, *args, **kwargs)
        compacted = meta is not attn_metadata
        step.caches[self.layer_name] = (layer, kv_cache)
        if step.slot_mapping is None:
            step.slot_mapping = attn_metadata.slot_mapping
        o = output.view(output.shape[0], self.impl.num_heads, -1)
        if gpu:
            gpu_tree_rows(step, query, kv_cache, attn_metadata.block_table, o,
                          self.impl.head_size, self.impl.scale)
        else:
            cpu_tree_rows(step, query, key, value, kv_cache, attn_metadata.block_table,
                          o, self.impl.scale, self.layout, all_nodes=compacted)
        return out


def split_tree_requests(qsl: list[int], rows: list[TreeRow]
                        ) -> tuple[list[int], list[int], dict[int, int]] | None:
    """The batch's request boundaries with every tree's nodes taken out of
    their request and made a request of their own, which both backends'
    compaction builds on (``compact_cpu_metadata``,
    ``compact_triton_metadata``).

    Returns the new boundaries, the old request each new one reads its
    blocks from, and the sequence length of every new request whose length
    is not its old request's (a tree request ends at its root; its nodes
    attend to the first ``num_nodes`` slots of the same blocks). None when
    there is no tree, or a tree's nodes do not end its request (not the
    layout the runner built)."""
    trees = {r.req_index: r for r in rows}
    if not trees:
        return None
    new_qsl, src, own_len = [0], [], {}
    for i in range(len(qsl) - 1):
        r = trees.get(i)
        if r is None:
            new_qsl.append(qsl[i + 1])
            src.append(i)
            continue
        first, n = r.row_start + 1, r.num_nodes  # every node is recomputed
        if first + n != qsl[i + 1]:
            return None
        new_qsl += [first, first + n]
        own_len[len(src)], own_len[len(src) + 1] = r.context_len + 1, n
        src += [i, i]
    return new_qsl, src, own_len


def compact_cpu_metadata(meta, rows: list[TreeRow], impl, isa: str, dtype: torch.dtype):
    """vLLM's CPU attention metadata with the tree nodes taken out of their
    requests (None when it cannot be done safely: the backend then attends
    every row, and the nodes are recomputed all the same).

    The backend attends a tree's nodes causally, which is wrong for every
    node after the tree's leading chain, and the wrapper recomputes those
    rows: at a 1000-token context that wasted work is about 7 ms of a
    53 ms 8-node step (the backend's kernel over 9 query rows instead of
    1). Here each tree request ends at its root (its sequence shortened by
    the nodes taken out), and the nodes become a request of their own that
    attends only to the first rows of the same request's blocks
    (``seq_len`` = its query length): cheap, finite, and overwritten by
    ``cpu_tree_rows``. Nothing is copied: the rows stay where they are, only
    the request boundaries and the kernel's schedule change.

    The tree's leading chain goes out with the other nodes (and is
    recomputed with them): the kernel's path for several query rows costs
    far more per row than its one-row decode path (at a 1000-token context
    49 vs 31 us a layer for 2 rows vs 1), more than the chain's rows cost
    the wrapper."""
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import ops

    if (getattr(meta, "dynamic_causal", None) is not None or not getattr(meta, "causal", False)
            or getattr(meta, "use_sdpa_prefill", False) or meta.encoder_cache is not None):
        return None
    seq = meta.seq_lens.tolist()
    if any(seq[r.req_index] != r.context_len + 1 + r.num_nodes for r in rows):
        return None  # not the layout the runner built: leave it alone
    split = split_tree_requests(meta.query_start_loc.tolist(), rows)
    if split is None:
        return None
    new_qsl, src, own_len = split
    new_seq = [own_len.get(j, seq[i]) for j, i in enumerate(src)]
    qsl_t = torch.tensor(new_qsl, dtype=meta.query_start_loc.dtype)
    seq_t = torch.tensor(new_seq, dtype=meta.seq_lens.dtype)
    blocks = meta.block_table.index_select(
        0, torch.tensor(src, dtype=torch.long, device=meta.block_table.device))
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(new_seq), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_t, dtype=dtype,
        query_start_loc=qsl_t, causal=True, sliding_window_size=impl.sliding_window,
        isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=impl.kv_cache_dtype)
    q_lens = np.diff(new_qsl)
    return replace(meta, query_start_loc=qsl_t, seq_lens=seq_t, block_table=blocks,
                   scheduler_metadata=sched, max_query_len=int(q_lens.max()),
                   max_seq_len=int(max(new_seq)))


def compact_triton_metadata(meta, rows: list[TreeRow], query_start_loc):
    """TRITON_ATTN's metadata with the tree nodes taken out of their
    requests, as ``compact_cpu_metadata`` does on CPU (None for another
    backend's metadata, or where it cannot be done safely: the backend then
    attends every row, and the nodes are recomputed all the same).

    The backend's kernel gives each program a few query tokens of one
    request and walks that request's whole context, so a tree's nodes in its
    request cost the backend one more context walk per few nodes, which
    ``gpu_tree_rows`` then overwrites. Here each tree request ends at its
    root and its nodes become a request of their own attending to the first
    ``num_nodes`` slots of the same blocks: cheap, finite, and overwritten.
    Built from the host's request boundaries and the tree rows' lengths (no
    read of the device); the sequence lengths of the other requests are
    gathered on the device."""
    if type(meta).__name__ != "TritonAttentionMetadata" or query_start_loc is None:
        return None
    if (meta.causal is not True or meta.mm_prefix_range_tensor is not None
            or meta.rswa_prefix_lens is not None):
        return None
    qsl = [int(x) for x in query_start_loc]
    n_req = len(qsl) - 1
    if meta.query_start_loc.shape[0] != n_req + 1 or meta.seq_lens.shape[0] != n_req:
        return None  # padded requests: not the layout the runner built
    split = split_tree_requests(qsl, rows)
    if split is None:
        return None
    new_qsl, src, own_len = split
    fixed, fixed_len = list(own_len), list(own_len.values())
    qsl_t, src_t, fixed_t, fixed_len_t = to_device_parts(
        [new_qsl, src, fixed, fixed_len], meta.seq_lens.device)
    seq = meta.seq_lens.index_select(0, src_t)
    seq[fixed_t] = fixed_len_t.to(seq.dtype)
    return replace(meta, query_start_loc=qsl_t.to(meta.query_start_loc.dtype),
                   seq_lens=seq, block_table=meta.block_table.index_select(0, src_t),
                   max_query_len=int(np.diff(new_qsl).max()))


def cpu_tree_rows(step: TreeStep, query, key, value, kv_cache, block_table, o,
                  scale: float, layout: str, all_nodes: bool = False) -> None:
    """CPU: recompute the tree rows of ``o`` ``[tokens, heads, head]`` in place:
    every node when the backend skipped them (``all_nodes``, see
    ``compact_cpu_metadata``), else the nodes after the leading chain (the
    backend's causal rows are right for the chain). The native kernel
    (``kernels/cpu_tree_attention``) when it is loaded and applies, else
    ``paged_tree_attention`` (ATen calls). The kernel's calls are built on
    the step's first layer and re-pointed at the others' tensors."""
    from vllm_specplug.kernels import cpu_tree_attention as native

    tensors = (query, kv_cache, block_table, key, value, o)
    layout_now = _native_layout(tensors)
    if step.native_layout is None:
        step.native_layout = layout_now
    reuse = layout_now == step.native_layout
    bases = [t.data_ptr() for t in tensors] if reuse and step.native else None
    k_cache = v_cache = None
    for idx, r in enumerate(step.rows):
        s, a = r.row_start, 0 if all_nodes else r.chain_prefix
        if a >= r.num_nodes:
            continue
        kept = step.native.get((idx, a)) if reuse else None
        if kept is not None:
            call, offsets = kept
            if call.run_at(*(bases[i] + off for i, off in offsets)):
                continue
        if k_cache is None:
            k_cache, v_cache = cpu_split_cache(kv_cache)
        rows = slice(s + 1 + a, s + 1 + r.num_nodes)
        call = native.prepare(
            query[rows], k_cache, v_cache, block_table[r.req_index], r.context_len,
            key[s : s + 1 + r.num_nodes], value[s : s + 1 + r.num_nodes],
            r.step_mask_u8()[a:], scale, layout, o[rows])
        if call is not None and call.run():
            if reuse:
                step.native[(idx, a)] = (call, _offsets(call, tensors))
            continue
        paged_tree_attention(
            query[rows], k_cache, v_cache, block_table[r.req_index], r.context_len,
            key[s : s + 1 + r.num_nodes], value[s : s + 1 + r.num_nodes],
            r.step_bias()[a:], scale, layout, out=o[rows])


def _native_layout(tensors) -> tuple:
    """What must match between two layers for one's kernel call to be
    re-pointed at the other's tensors."""
    query, kv_cache = tensors[0], tensors[1]
    return (query.dtype, kv_cache.dtype, kv_cache.shape, *(t.stride() for t in tensors))


_POINTERS = (("q", 0), ("k_cache", 1), ("v_cache", 1), ("block_ids", 2), ("k_step", 3),
             ("v_step", 4), ("out", 5))
"""The kernel's pointer arguments, in ``Call.run_at``'s order, and the tensor
of ``cpu_tree_rows``' ``tensors`` each lies in."""


def _offsets(call, tensors) -> tuple[tuple[int, int], ...]:
    """Each pointer argument of ``call`` as (tensor, byte offset into it)."""
    return tuple((i, getattr(call.args, name) - tensors[i].data_ptr())
                 for name, i in _POINTERS)


def paged_tree_attention(q, k_cache, v_cache, block_ids, context_len: int,
                         k_step, v_step, step_bias, scale: float, layout: str,
                         out: torch.Tensor | None = None):
    """Tree nodes' attention with the context read block by block from vLLM's
    CPU cache.

    q ``[n, H, D]`` (the nodes recomputed: all, or those after the tree's
    leading chain); ``k_cache``/``v_cache`` as :func:`cpu_split_cache` gives
    them; k/v_step ``[m, Hkv, D]`` (root + every node); ``step_bias``
    ``[n, m]`` float, 0 where a node sees a step row and -inf where not.
    Writes ``out`` ``[n, H, D]`` (a view of the layer's output rows) when
    given; returns the result.

    Each context block is copied once (``index_select``) and multiplied
    where it lies; the scores of the step rows and of the context share one
    buffer, so one softmax covers both. At small contexts the cost is the
    number of ATen calls (about 8 us each on a 2-core CPU), not arithmetic:
    keep them few.
    """
    n, h, d = q.shape
    m, hkv = k_step.shape[0], k_step.shape[1]
    rep = h // hkv
    rows = n * rep
    kt, vb = context_blocks(k_cache, v_cache, block_ids, context_len, layout)
    nblk, bs = kt.shape[0], kt.shape[3]
    span = nblk * bs
    if context_len < span:
        # the last block's unused slots hold whatever the cache held (even
        # NaN): their weight is 0, and 0 * NaN is NaN
        vb[-1, :, context_len - span + bs:] = 0
    qg = torch.mul(q.float(), scale).view(n, hkv, rep, d).transpose(0, 1).reshape(hkv, rows, d)
    scores = torch.empty(hkv, rows, m + span, dtype=qg.dtype, device=qg.device)
    bias = step_bias[:, None, :].expand(n, rep, m).reshape(rows, m)
    scores[:, :, :m] = torch.baddbmm(bias, qg, k_step.float().permute(1, 2, 0))
    ctx = scores[:, :, m:].unflatten(-1, (nblk, bs)).permute(2, 0, 1, 3)  # [nblk, Hkv, rows, bs]
    ctx.copy_(torch.matmul(qg.unsqueeze(0), kt.float()))
    if context_len < span:
        scores[:, :, m + context_len:] = float("-inf")  # (NaN keys too)
    p = torch.softmax(scores, dim=-1)
    res = torch.matmul(p[:, :, m:].unflatten(-1, (nblk, bs)).permute(2, 0, 1, 3),
                       vb.float()).sum(0)  # [Hkv, rows, D]
    res.baddbmm_(p[:, :, :m], v_step.float().transpose(0, 1))
    res = res.view(hkv, n, rep, d).transpose(0, 1)
    if out is None:
        return res.reshape(n, h, d).to(q.dtype)
    out.view(n, hkv, rep, d).copy_(res)
    return out


def gpu_tree_rows(step: TreeStep, query, kv_cache, block_table, o, head_size: int,
                  scale: float) -> None:
    """GPU: the tree rows through the Triton kernel, reading every key
    (context, root, nodes) from the paged cache, which vLLM has already
    written. No host sync: the kernel's inputs are built once per step."""
    from vllm_specplug.kernels.tree_attention import tree_attention

    g = step.gpu_inputs(query.device)
    k_cache, v_cache = gpu_split_cache(kv_cache, head_size)
    # long contexts at small batch: the kernel splits them (the root is
    # context to the nodes' rows)
    out = tree_attention(
        query.index_select(0, g["rows"]), k_cache, v_cache,
        block_table.index_select(0, g["req"]), g["seq_lens"], g["qsl"], scale,
        tree_mask=g["tree_mask"], num_segments=None,
        max_context_len=max(r.context_len + 1 for r in step.rows),
    )
    o.index_copy_(0, g["rows"], out.to(o.dtype))


def move_accepted_kv(step: TreeStep, src_rows, dst_rows, moves: "LayerMoves") -> None:
    """Copy the K/V of flat rows ``src_rows`` to the slots of ``dst_rows``, in
    every layer's cache (``moves``: the engine's), from the cache's own slots
    (all sources are read before any destination is written)."""
    if len(src_rows) == 0 or step.slot_mapping is None:
        return
    slots = step.slot_mapping
    rows = to_device(np.concatenate([src_rows, dst_rows]), torch.long, slots.device)
    picked = slots[rows].long()
    moves.move(step, picked[: len(src_rows)], picked[len(src_rows):])


class LayerMoves:
    """One engine's layer caches as the KV move takes them: every distinct
    cache's K and V slot views and, on GPU, their base-address table
    (``kv_move.cache_table``), built at the first move, not every step.
    Held by the engine's runner, so the views die with its caches.
    ``layout``: ``"gpu"`` or the CPU layout (see ``slot_views``)."""

    def __init__(self, head_size: int, layout: str):
        self.head_size, self.layout = head_size, layout
        self.views: list[torch.Tensor] = []
        self.table: torch.Tensor | bool | None = None
        """The views' address table; False where the kernel cannot take them."""
        self._addresses: tuple[int, ...] | None = None

    def move(self, step: TreeStep, src_slots, dst_slots) -> None:
        caches = [kv for _, kv in step.caches.values()]
        # The views hold the caches: none of them can be freed and its address
        # reused while they are here, so equal addresses are the same caches.
        addresses = tuple(c.data_ptr() for c in caches)
        if addresses != self._addresses:
            self._build(caches)
            self._addresses = addresses
        if self.layout == "gpu" and self._move_all(src_slots, dst_slots):
            return
        from vllm_specplug.kernels.kv_move import kv_move

        for k, v in zip(self.views[::2], self.views[1::2]):
            kv_move(k, v, src_slots, dst_slots)

    def _build(self, caches: list[torch.Tensor]) -> None:
        self.views, self.table, done = [], None, set()
        for kv_cache in caches:
            # Layers sharing one cache (kv_sharing_target_layer_name) move once:
            # a second pass would read slots the first one already overwrote.
            key = (kv_cache.data_ptr(), tuple(kv_cache.stride()))
            if key not in done:
                done.add(key)
                self.views += slot_views(kv_cache, self.head_size, self.layout)

    def _move_all(self, src_slots, dst_slots) -> bool:
        """Every layer's K and V moved in one launch pair (GPU), or False where
        the kernel cannot take these caches (then each layer moves alone)."""
        from vllm_specplug.kernels import use_triton
        from vllm_specplug.kernels.kv_move import _kv_gather_kernel, cache_table, kv_move_caches

        if self.table is False or not self.views or not use_triton(
                _kv_gather_kernel, self.views[0], src_slots):
            return False
        if self.table is None:
            try:
                self.table = cache_table(self.views)
            except ValueError:
                self.table = False
                return False
        kv_move_caches(self.views, src_slots, dst_slots, self.table)
        return True
