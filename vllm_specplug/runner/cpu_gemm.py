"""A drafter's ``nn.Linear`` layers on vLLM's own CPU GEMM kernels.

vLLM runs the target's linear layers on CPU through kernels with prepacked
weights (oneDNN, or SGL's on AMX machines), picked per layer by
``dispatch_cpu_unquantized_gemm``. A drafter built from plain ``nn.Linear``
(the EAGLE-3 head) would run torch's unpacked GEMM instead, which here was
3-4x slower for the head's shapes (its 12288 x 576 LM head: 2.3 vs 0.6 ms
for one row, 4.6 vs 1.0 ms for ten). Handed to methods as
``ProposerContext.prepare_linears``; only drafts go through it, so the
output stays lossless whatever the kernel's rounding.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _packed_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # vLLM's CPU kernels take [tokens, in]; the head also calls with [B, m, in]
    y = layer.cpu_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def prepare_cpu_linears(module: torch.nn.Module) -> int:
    """Route every CPU ``nn.Linear`` of ``module`` through vLLM's CPU GEMM
    dispatch; returns how many were routed.
    The weights stay in place (training code and state dicts still see them)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = 0
    for layer in module.modules():
        if not isinstance(layer, torch.nn.Linear) or layer.weight.device.type != "cpu":
            continue
        try:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        except Exception as e:  # noqa: BLE001 - torch's GEMM is still right
            logger.warning("specplug: vLLM's CPU GEMM unavailable for a drafter layer "
                           "(%s); torch's is used", e)
            return n
        if getattr(layer, "cpu_linear", None) is None:
            continue
        layer.forward = _packed_forward.__get__(layer)
        n += 1
    return n
