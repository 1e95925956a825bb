"""Tree attention for the verification rows, on top of vLLM's own backend.

vLLM's attention kernels are causal: node ``j`` of a draft tree would see
every node laid out before it, siblings included. We let the backend run as
usual (it is right for every row that is not a tree node: prefills, chains,
the tree's root) and then recompute the tree rows with a per-request
ancestor mask:

- context keys (positions before the root) come from the paged cache, read
  through ``read_context_kv`` whose layout assumption is checked once at
  start-up by a round trip through the backend's own writer;
- the step's own keys (root + nodes) come straight from the layer's inputs,
  so the nodes' slots in the cache are never read.

The same wrapper captures the tree rows' K/V so that, after acceptance, the
accepted path can be written to consecutive slots with the backend's writer
(``do_kv_cache_update``), whatever the backend's in-block layout is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TreeRow:
    """One request whose draft is a real tree (not a chain) in this step."""

    row_start: int
    """Flat index of the root row (the last verified token) in the batch."""
    num_nodes: int
    """Tree nodes after the root (rows ``row_start+1 .. row_start+num_nodes``)."""
    context_len: int
    """Tokens already in the cache before the root (= the root's position)."""
    req_index: int
    """The request's batch row (its block-table row in the attention metadata)."""
    mask: torch.Tensor
    """``[num_nodes, num_nodes + 1]`` bool: node row -> visible step rows."""


@dataclass
class TreeStep:
    """Everything the attention wrapper needs for one forward pass."""

    rows: list[TreeRow]
    capture: dict[str, tuple] = field(default_factory=dict)
    """layer name -> (layer, kv_cache, key rows, value rows) of tree requests."""
    slot_mapping: torch.Tensor | None = None
    """The step's slot per flat token row (where the KV move writes to)."""

    def capture_index(self) -> torch.Tensor:
        idx = [
            torch.arange(r.row_start, r.row_start + r.num_nodes + 1)
            for r in self.rows
        ]
        return torch.cat(idx)


def cpu_split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, kv_heads, block_size, 2*head]`` viewed as
    key and value caches ``[blocks, kv_heads, block_size, head]`` (the same
    view ``CPUAttentionBackendImpl`` takes)."""
    nb, kvh, bs, two_d = kv_cache.shape
    kv = kv_cache.view(nb, kvh, bs * 2, two_d // 2)
    return kv[:, :, :bs], kv[:, :, bs:]


# In-block layouts of vLLM's CPU cache seen per ISA path. "k_transposed"
# (the vec/vec16 paths) stores a key block as [kv_heads, head, block_size] and a
# value block as [kv_heads, block_size, head]. The runner picks the one that
# survives a round trip through the backend's writer at start-up.
CPU_KV_LAYOUTS = ("k_transposed", "plain")


def read_context_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
    layout: str = "k_transposed",
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``0 .. length-1``, each ``[length, kv_heads, head]``."""
    k_cache, v_cache = cpu_split_cache(kv_cache)
    block_size = k_cache.shape[2]
    nblk = (length + block_size - 1) // block_size
    ids = block_ids[:nblk].long()

    def gather(cache: torch.Tensor, transposed: bool) -> torch.Tensor:
        blocks = cache.index_select(0, ids)  # [nblk, kvh, bs, d] as stored
        n, kvh, bs, d = blocks.shape
        if transposed:
            # Same bytes, read as [kvh, d, bs].
            blocks = blocks.reshape(n, kvh, d, bs).transpose(2, 3)
        return blocks.permute(0, 2, 1, 3).reshape(n * bs, kvh, d)[:length]

    return gather(k_cache, layout == "k_transposed"), gather(v_cache, False)


def masked_tree_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_step: torch.Tensor,
    v_step: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of tree nodes.

    q ``[n, H, D]``; k/v_ctx ``[c, Hkv, D]`` (all visible); k/v_step
    ``[n+1, Hkv, D]`` (root + nodes, visible per ``mask [n, n+1]``).
    Returns ``[n, H, D]`` in q's dtype; softmax in float32. Query heads are
    grouped per KV head so K/V are never repeated (two bmm per call: on one
    CPU thread this beats SDPA and einsum several times for these shapes).
    """
    n, h, d = q.shape
    hkv = k_step.shape[1]
    rep = h // hkv
    k = torch.cat([k_ctx, k_step]).float().permute(1, 2, 0)  # [Hkv, D, T]
    v = torch.cat([v_ctx, v_step]).float().transpose(0, 1)  # [Hkv, T, D]
    qg = q.float().view(n, hkv, rep, d).permute(1, 0, 2, 3).reshape(hkv, n * rep, d)
    scores = torch.bmm(qg, k).mul_(scale).view(hkv, n, rep, -1)
    visible = torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device)
    visible[:, k_ctx.shape[0]:] = mask
    scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(hkv, n * rep, -1)
    out = torch.bmm(probs, v).view(hkv, n, rep, d).permute(1, 0, 2, 3)
    return out.reshape(n, h, d).to(q.dtype)


class TreeAttentionWrapper:
    """Wraps one attention layer's ``impl.forward`` (see module docstring)."""

    layout = "k_transposed"
    """Set once by the runner's start-up round trip (see CPU_KV_LAYOUTS)."""

    def __init__(self, layer_name: str, impl, get_step) -> None:
        self.layer_name = layer_name
        self.impl = impl
        self.inner = impl.forward
        self.get_step = get_step

    def __call__(self, layer, query, key, value, kv_cache, attn_metadata,
                 output, *args, **kwargs):
        out = self.inner(layer, query, key, value, kv_cache, attn_metadata,
                         output, *args, **kwargs)
        step: TreeStep | None = self.get_step()
        if step is None or attn_metadata is None or not step.rows:
            return out
        idx = step.capture_index().to(key.device)
        step.capture[self.layer_name] = (
            layer, kv_cache, key.index_select(0, idx), value.index_select(0, idx)
        )
        if step.slot_mapping is None:
            step.slot_mapping = attn_metadata.slot_mapping
        o = output.view(output.shape[0], self.impl.num_heads, -1)
        if kv_cache.is_cuda:
            self._fix_rows_cuda(step, query, kv_cache, attn_metadata, o)
            return out
        for r in step.rows:
            s = r.row_start
            k_ctx, v_ctx = read_context_kv(
                kv_cache, attn_metadata.block_table[r.req_index], r.context_len,
                self.layout,
            )
            o[s + 1 : s + 1 + r.num_nodes] = masked_tree_attention(
                query[s + 1 : s + 1 + r.num_nodes],
                k_ctx, v_ctx,
                key[s : s + 1 + r.num_nodes],
                value[s : s + 1 + r.num_nodes],
                r.mask,
                self.impl.scale,
            )
        return out


    def _fix_rows_cuda(self, step, query, kv_cache, attn_metadata, o) -> None:
        """GPU: the tree rows through the Triton kernel, reading every key
        (context, root, nodes) from the paged cache, which vLLM has already
        written. Cache layout of the FLASH_ATTN/TRITON_ATTN backends:
        ``[2, blocks, block_size, kv_heads, head]``."""
        from vllm_specplug.kernels.tree_attention import pack_tree_mask, tree_attention

        dev = query.device
        k_cache, v_cache = kv_cache.unbind(0)
        rows = torch.cat([torch.arange(r.row_start + 1, r.row_start + 1 + r.num_nodes)
                          for r in step.rows]).to(dev)
        n = torch.tensor([r.num_nodes for r in step.rows])
        qsl = torch.zeros(len(step.rows) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(n, 0)
        seq_lens = torch.tensor([r.context_len + 1 + r.num_nodes for r in step.rows],
                                dtype=torch.int32)
        idx = torch.tensor([r.req_index for r in step.rows], device=dev)
        masks = torch.cat([pack_tree_mask(r.mask[:, 1:].cpu()) for r in step.rows])
        out = tree_attention(
            query.index_select(0, rows), k_cache, v_cache,
            attn_metadata.block_table.index_select(0, idx), seq_lens.to(dev),
            qsl.to(dev), self.impl.scale, tree_mask=masks.to(dev),
        )
        o.index_copy_(0, rows, out.to(o.dtype))


def move_accepted_kv(step: TreeStep, moves: list[tuple[int, int]]) -> None:
    """Write captured K/V rows to new slots with each backend's own writer.

    ``moves``: (index into the capture rows, destination slot).
    """
    if not moves:
        return
    src = torch.tensor([m[0] for m in moves], dtype=torch.long)
    dst = torch.tensor([m[1] for m in moves], dtype=torch.long)
    for layer, kv_cache, k_rows, v_rows in step.capture.values():
        layer.impl.do_kv_cache_update(
            layer,
            k_rows.index_select(0, src.to(k_rows.device)),
            v_rows.index_select(0, src.to(v_rows.device)),
            kv_cache,
            dst.to(kv_cache.device),
        )
