"""A drafter's ``nn.Linear`` layers on vLLM's own CPU GEMM kernels.

vLLM runs the target's linear layers on CPU through kernels with prepacked
weights (oneDNN, or SGL's on AMX machines), picked per layer by
``dispatch_cpu_unquantized_gemm``. A drafter built from plain ``nn.Linear``
(the EAGLE-3 head) would run torch's unpacked GEMM instead, which is
3-4x slower on a 2-core CPU for the head's shapes (its 12288 x 576 LM head: 2.3 vs 0.6 ms
for one row, 4.6 vs 1.0 ms for ten). Handed to methods as
``ProposerContext.prepare_linears``; only drafts go through it, so the
output stays lossless whatever the kernel's rounding. A drafter may ask for
its layers to run with bfloat16 weights (``weight_dtype``): each call then
streams half the bytes, which is what a few-row GEMM on a CPU waits for.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


def _packed_forward(layer, x: torch.Tensor) -> torch.Tensor:
    # vLLM's CPU kernels take [tokens, in]; the head also calls with [B, m, in].
    # The casts are no-ops unless the weights are a _CastGemm's.
    rows = x.reshape(-1, x.shape[-1]).to(layer.weight.dtype)
    y = layer.cpu_linear(rows, layer.weight, layer.bias).to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


class _CastGemm:
    """A layer's weight and bias in another dtype, on vLLM's GEMM for that
    dtype: called with the layer's inputs, it returns the layer's dtype."""

    def __init__(self, layer: torch.nn.Linear, dtype: torch.dtype) -> None:
        self.weight = torch.nn.Parameter(layer.weight.detach().to(dtype), requires_grad=False)
        self.bias = (None if layer.bias is None
                     else torch.nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False))
        self.cpu_linear = None  # set by vLLM's dispatch

    __call__ = _packed_forward


def prepare_cpu_linears(module: torch.nn.Module,
                        weight_dtype: torch.dtype | None = None) -> int:
    """Route every CPU ``nn.Linear`` of ``module`` through vLLM's CPU GEMM
    dispatch; returns how many were routed. ``weight_dtype`` (e.g.
    bfloat16): run them on a copy of the weights in that dtype, inputs cast
    to it and outputs back; None: the layers' own dtype.
    The weights stay in place (training code and state dicts still see them)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = 0
    layers = [m for m in module.modules()
              if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu"]
    for layer in layers:
        cast = (_CastGemm(layer, weight_dtype)
                if weight_dtype not in (None, layer.weight.dtype) else None)
        try:
            # the cast copy may go once packed: only the kernel reads it then
            dispatch_cpu_unquantized_gemm(cast or layer, remove_weight=cast is not None)
        except Exception as e:  # noqa: BLE001 - torch's GEMM is still right
            logger.warning("specplug: vLLM's CPU GEMM unavailable for a drafter layer "
                           "(%s); torch's is used", e)
            return n
        if cast is not None:
            layer.forward = cast  # a closure, not a submodule: state dicts stay the head's
        elif getattr(layer, "cpu_linear", None) is not None:
            layer.forward = _packed_forward.__get__(layer)
        else:
            continue
        n += 1
    return n


_routing = 0  # > 0 while a specplug engine loads its models in this process


@contextlib.contextmanager
def cpu_linear_routing(on: bool = True):
    """While the block runs, every float32 linear layer vLLM prepares for CPU
    (``dispatch_cpu_unquantized_gemm``: the target's layers and LM head as
    it loads, a drafter's through ``prepare_cpu_linears``) is offered to
    ``kernels.cpu_linear``, which takes its small calls where it is bitwise
    equal to vLLM's choice. Yields whether the kernel is in use. Only the
    specplug runner's model loading routes: a plain engine started later in
    the same process (tests, notebooks) must keep vLLM's layers, since its
    compile cache key says nothing of the kernel."""
    global _routing
    import vllm.model_executor.layers.utils as vllm_utils

    from vllm_specplug.kernels import cpu_linear

    if not (on and cpu_linear.ensure_loaded()):
        yield False
        return
    original = vllm_utils.dispatch_cpu_unquantized_gemm
    if not getattr(original, "_specplug", False):
        def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
            weight = layer.weight  # vLLM may drop it (remove_weight): keep a reference
            original(layer, remove_weight)
            if _routing > 0 and not weight.is_meta:
                cpu_linear.route(layer, weight)

        dispatch._specplug = True
        # linear.py and vocab_parallel_embedding.py import it from the module
        # at call time, so replacing the module's attribute reaches both
        vllm_utils.dispatch_cpu_unquantized_gemm = dispatch
    if _routing == 0:
        cpu_linear.take_routed()  # what routed before this load is not this load's
    _routing += 1
    try:
        yield True
    finally:
        _routing -= 1
