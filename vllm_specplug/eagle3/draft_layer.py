"""The head's decoder layer as drafting runs it: fewer, larger operations.

:class:`Eagle3Draft` keeps the checkpoint's layout (separate q, k, v, gate
and up projections, each RMS norm its own module, rotary angles computed
from the positions on every call) because training and vLLM's loader need
it. A drafting level runs that layer on a handful of rows, where a CPU
spends much of its time per operation rather than on arithmetic: the
training forward issues about forty of them for q/k/v alone. (The other
floor is the weights' bytes: after a target step they are out of the
cache, and a pass reads all of them whatever the number of operations.)
This module computes the same function with

* one GEMM for q, k and v, and one for the MLP's gate and up projections;
* the RMS norms' weights folded into the columns of the GEMM after them,
  so each norm is one ``rms_norm`` without a weight (the embedding's and the
  hidden state's norms in one call over a ``[rows, 2, hidden]`` view);
* rotary cos/sin read from a table grown on demand, applied to q and k in
  one pass (``rotate_half`` as one ``roll`` times a signed sin).

It holds a snapshot of the head's weights (o_proj and down_proj shared, the
fused ones copied once). Its outputs equal the training forward's up to
float rounding; only drafts use it, and every draft is verified by the
target, so output never depends on it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_specplug.eagle3.model import Eagle3Draft

__all__ = ["DraftLayer"]


def _fused_linear(weights: list[torch.Tensor], column_scale: torch.Tensor) -> nn.Linear:
    """One bias-free linear whose output is the concatenation of
    ``weights``' outputs on an input scaled by ``column_scale``."""
    w = torch.cat([x.detach() for x in weights]) * column_scale.detach()[None, :]
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    layer.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    return layer


class DraftLayer(nn.Module):
    """``qkv`` and ``post``: :meth:`Eagle3Draft._qkv` and
    :meth:`Eagle3Draft._post` for drafting (see the module doc)."""

    ROPE_ROWS = 1024
    """Positions the rotary table starts with (it doubles past them)."""

    def __init__(self, head: Eagle3Draft) -> None:
        super().__init__()
        ml = head.midlayer
        attn, mlp = ml.self_attn, ml.mlp
        self.hidden = head.cfg["hidden_size"]
        self.nh, self.nkv, self.hd = attn.nh, attn.nkv, attn.hd
        self.inter = mlp.gate_proj.out_features
        self.eps = ml.input_layernorm.eps
        self.embed = head.embed  # shared, never copied
        input_scale = torch.cat([ml.input_layernorm.weight, ml.hidden_norm.weight])
        self.qkv_proj = _fused_linear(
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], input_scale)
        self.o_proj = attn.o_proj
        self.gate_up_proj = _fused_linear([mlp.gate_proj.weight, mlp.up_proj.weight],
                                          ml.post_attention_layernorm.weight)
        self.down_proj = mlp.down_proj
        self._angles = head.rope_cos_sin
        self._cos = self._sin = head.inv_freq.new_empty(0, self.hd)

    def _rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)`` rows of ``pos``, each ``[T, 1, hd]``."""
        upto = int(pos.max()) + 1 if pos.numel() else 0
        if upto > self._cos.shape[0]:
            rows = max(upto, 2 * self._cos.shape[0], self.ROPE_ROWS)
            # the head's own angles, the ones its training forward computes per call
            cos, sin = self._angles(torch.arange(rows, device=self._cos.device))
            sin[:, :self.hd // 2].neg_()  # rotate_half(x) * sin == roll(x) * signed sin
            self._cos, self._sin = cos, sin
        return self._cos[pos][:, None, :], self._sin[pos][:, None, :]

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """``(q [T, nh, hd], k [T, nkv, hd], v [T, nkv, hd])`` of rows fed
        ``tokens`` and ``hidden`` at positions ``pos``."""
        t = tokens.shape[0]
        x = torch.cat([F.embedding(tokens, self.embed), hidden], dim=-1)
        x = F.rms_norm(x.view(t, 2, self.hidden), (self.hidden,), eps=self.eps)
        y = self.qkv_proj(x.view(t, 2 * self.hidden)).view(t, -1, self.hd)
        n_rot = self.nh + self.nkv
        qk = y[:, :n_rot]
        cos, sin = self._rotary(pos)
        qk = qk * cos + qk.roll(self.hd // 2, dims=-1) * sin
        return qk[:, :self.nh], qk[:, self.nh:], y[:, n_rot:]

    def post(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + residual + MLP: the pre-norm output (what vLLM feeds back)."""
        h = self.o_proj(attn.reshape(attn.shape[0], -1)).add_(residual)
        gate_up = self.gate_up_proj(F.rms_norm(h, (self.hidden,), eps=self.eps))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up)).add_(h)
