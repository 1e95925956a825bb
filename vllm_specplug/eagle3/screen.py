"""The head's LM head on a CPU: an int8 screen, then the exact logits of the
tokens it keeps.

Why: each drafting level runs the head's LM head over its frontier rows.
Over the reference head's 12,288-token draft vocabulary that is 28 MB of
float32 weights per level, streamed from memory for a handful of rows: the
largest single cost of a drafting level on a CPU. An int8 copy of the
weights (one scale per output token, PyTorch's dynamic quantization) reads a
quarter of the bytes. Its logits rank the vocabulary almost as the float32
ones do, but not exactly (a few percent of rows swap their two best tokens),
so they only screen: each row's ``screen`` best tokens by the int8 logits
get their logits recomputed exactly from the float32 weight rows, and the
log-normaliser takes those exact logits plus the int8 ones of every other
token (far below the row's best, whose share of the mass is small). The
final norm's weight is folded into the LM head's columns, so the int8
activations are the plain RMS-normalised rows: the norm's largest channels
would otherwise set every row's quantization step (that halves the
log-probability error, to a few hundredths of a nat on the reference head). A
draft's tokens and scores are then those of the float32 head unless a token
of a row's true top-k ranks below ``screen`` in the int8 logits.

Drafts only: every draft is verified by the target, so output never depends
on this. Not used on GPUs (their LM head pass is cheap next to a target
step) or where PyTorch has no quantized CPU engine.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SCREEN = 32
"""Tokens per row recomputed exactly (at least twice the top-k asked)."""


class ScreenedLogits:
    """``top(prenorm, k)``: a row's ``k`` best draft tokens and their
    log-probabilities, from the int8 screen and the exact rows."""

    def __init__(self, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 screen: int = SCREEN) -> None:
        """``weight``: the LM head's ``[vocab, hidden]``; ``norm_weight``,
        ``eps``: the RMS norm before it."""
        self.weight = weight.detach()  # the head's own: the exact rows, no copy
        self.norm_weight = norm_weight.detach().float()
        folded = self.weight.float() * self.norm_weight[None, :]
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(folded, requires_grad=False)
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        self.int8 = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(linear), {torch.nn.Linear: qconfig})[0]
        self.eps = eps
        self.screen = screen

    @classmethod
    def build(cls, lm_head: torch.nn.Linear, norm: torch.nn.Module) -> ScreenedLogits | None:
        """The screen of a CPU float32 LM head after the RMS norm ``norm``
        (its ``weight`` and ``eps``), or None where it cannot run here
        (logged)."""
        weight = lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        try:
            with warnings.catch_warnings():
                # PyTorch marks its quantization API deprecated (in favour of
                # torchao, which this CPU install lacks); without it the
                # head's LM head runs in float32, as on every other failure
                warnings.simplefilter("ignore")
                screen = cls(weight, norm.weight, norm.eps)
                screen.top(torch.ones(1, weight.shape[1]), 1)  # the kernels run here
        except (RuntimeError, NotImplementedError, AttributeError, ImportError) as e:
            logger.warning("specplug: no int8 screen for the EAGLE-3 head's LM head (%s); "
                           "it runs in float32", e)
            return None
        return screen

    @torch.no_grad()
    def top(self, prenorm: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``prenorm [..., hidden]``: the head's rows before the norm.
        Returns ``(logp [..., k], ids [..., k])``, best first, as
        ``log_softmax(lm_head(norm(prenorm))).topk(k)`` gives them up to the
        screen's misses and its error in the normaliser."""
        shape = prenorm.shape[:-1]
        rows = prenorm.reshape(-1, prenorm.shape[-1]).float()
        rows = F.rms_norm(rows, (rows.shape[-1],), eps=self.eps)
        approx = self.int8(rows)  # [n, vocab]
        keep = min(max(self.screen, 2 * k), approx.shape[-1])
        cand = approx.topk(keep, dim=-1, sorted=False).indices  # [n, s]
        # (a product and a sum, not bmm: several times faster at these shapes)
        normed = rows * self.norm_weight
        exact = (F.embedding(cand, self.weight) * normed[:, None, :]).sum(-1)
        approx.scatter_(-1, cand, exact)
        # log_softmax's first column gives the normaliser faster than logsumexp
        lse = approx[:, :1] - torch.log_softmax(approx, dim=-1)[:, :1]
        logp = exact - lse
        vals, j = logp.topk(min(k, keep), dim=-1)
        ids = cand.gather(-1, j)
        return vals.view(*shape, -1), ids.view(*shape, -1)
