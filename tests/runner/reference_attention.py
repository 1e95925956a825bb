"""Tree attention on gathered K/V: the reference the paged paths (the CPU
wrapper's ``paged_tree_attention``, the GPU Triton kernel) are compared
with. It is itself checked against a per-query loop
(``test_tree_attention_paths.py``)."""

from __future__ import annotations

import torch


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
    Returns ``[n, H, D]`` in q's dtype; softmax in float32.
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
