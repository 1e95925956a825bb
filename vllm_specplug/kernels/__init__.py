"""Triton kernels for speculative decoding on vLLM's paged KV cache.

Modules (each exposes ``<name>_triton`` = the Triton launch and ``<name>_ref``
= a pure-torch reference that doubles as the CPU fallback, plus a small
dispatcher that picks one of the two):

* ``tree_attention`` - tree-masked paged attention for draft-tree verification.
* ``kv_move``        - compact the accepted path's K/V into consecutive slots.
* ``adjacency``      - token adjacency table update / static tree expansion.

And one native CPU kernel (not Triton: vLLM's CPU build has no Triton
backend): ``cpu_tree_attention`` - the tree rows' attention on vLLM's paged
CPU cache, C++ compiled on the user's machine at first use (ATen fallback).

The submodules are deliberately not imported here: ``@triton.jit`` decides at
decoration (= import) time whether a kernel is compiled for a GPU or run by
the CPU interpreter (``TRITON_INTERPRET=1``), so importing this package must
not freeze that choice as a side effect.
"""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET_ON_CPU", "interpret_mode", "kernel_is_interpreted", "use_triton"]


def interpret_mode() -> bool:
    """Whether kernels decorated *from now on* run in Triton's CPU interpreter."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_is_interpreted(kernel) -> bool:
    """Whether an already-decorated ``@triton.jit`` kernel is an interpreter one.

    This, not ``TRITON_INTERPRET`` now, is what decides whether a launch can
    take CPU tensors (the variable may have changed since the module was
    imported); ``INTERPRET_ON_CPU`` decides whether it does.
    """
    return type(kernel).__name__ == "InterpretedFunction"


INTERPRET_ON_CPU = "SPECPLUG_INTERPRET_ON_CPU"
"""Environment variable: ``1`` lets interpreter kernels take CPU tensors.

Set by the kernel check kit and the kernel tests. Without it an engine on
CPU takes the torch path even where the kernels were decorated for the
interpreter: ``TRITON_INTERPRET=1`` in the environment (or a test module
that set it) would otherwise run every tree step's KV move, attention and
table updates in Triton's interpreter, many times slower than the path CPU
users run."""


def use_triton(kernel, *tensors: torch.Tensor) -> bool:
    """True if ``kernel`` can be launched on ``tensors``.

    Compiled kernels need every tensor on a GPU (vLLM's CPU build has no
    Triton backend, so CPU tensors take the torch path). Interpreter kernels
    run on CPU tensors, but only where ``INTERPRET_ON_CPU`` asks for them.
    """
    if kernel_is_interpreted(kernel):
        return os.environ.get(INTERPRET_ON_CPU) == "1"
    return all(t.is_cuda for t in tensors)
