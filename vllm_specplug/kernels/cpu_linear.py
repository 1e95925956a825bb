"""The target's float32 linear layers on CPU for a few rows, bitwise equal to
vLLM's oneDNN path.

Why: on a 2-core CPU a decode or tree-verify step is mostly linear layers
(vLLM's ``onednn_mm``: ~70 % of an 8-node tree step on the reference
model). For a handful of rows oneDNN streams the weights at ~9-10 GB/s on
such a CPU, and on AVX2 its cost grows with the rows: 9 rows cost ~1.5x one
row, so an 8-node tree step pays ~22 ms more than a plain step in the
linear layers alone. ``cpu_linear.cpp`` reads each weight panel from memory once for all
rows (up to ``MAX_ROWS``) and keeps the FMA units busy.

Why it stays lossless: vLLM's oneDNN computes each output as FMA chains over
blocks of k in order (1024 with AVX2; 512, or 1024 for some shapes at more
than one row, with AVX-512), each block from zero, the blocks' sums added in
order -- and a row's bits do not depend on the other rows of its call (that
is what keeps float32 tree verification token-identical) -- and so does the
kernel. That is checked, not assumed: before a layer shape is routed, every
row count 1..``MAX_ROWS`` is run through both on random inputs and must
match bit for bit, with one of the block sizes in ``SUM_BLOCKS`` (found per
row count); a shape where some row count matches none stays on oneDNN, as
does every call with more rows (prefill, large batches), layers with a bias
and other dtypes. The op is a torch op, so the
compiled graph calls it like ``onednn_mm``; the routing is part of the
compile cache's key.

Cost: a packed copy of every routed weight (oneDNN keeps its own for the
calls with more rows): +0.5 GB on the reference model in float32.

Built like ``cpu_tree_attention`` (same build and cache, its own source and
``-ffp-contract=fast``: the chain must be fused multiply-adds). Used only in
engines running a specplug method; ``SPECPLUG_CPU_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from vllm_specplug.kernels import cpu_tree_attention as _build

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_linear.cpp")
FLAGS = _build.FLAGS + ("-ffp-contract=fast",)
ENV_SWITCH = "SPECPLUG_CPU_LINEAR"
MAX_ROWS = 24
"""Calls with more rows go to oneDNN (which wins once it is compute-bound);
the load-time check covers every row count up to this."""
SUM_BLOCKS = (0, 512, 1024)
"""The k-block sizes tried, in order, for each row count of a shape's
load-time check (0: one chain over all of K). oneDNN's brgemm on x86 sums K
in blocks, each one FMA chain, the blocks' sums added in order; the block
depends on the CPU and on the call's shape, rows included. AVX2 (an AMD
EPYC): 1024 at every row count (K = 1536: chains over k < 1024
and k >= 1024 added; likewise at K = 1025, 1152, 2048, 2560, 3072 and
4096). AVX-512 (an Intel Xeon with AMX): 512 at every row count for
K = 576, and for K = 1536 512 at one row but 1024 at 2-24 rows -- so the
block is found per row count. A block of at least K is one chain, so for
K <= 512 only 0 is tried."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


@dataclass
class _Layer:
    packed: torch.Tensor  # [N / panel][K][panel]
    blocks: tuple[int, ...]  # k per summed block (SUM_BLOCKS) for 1..MAX_ROWS rows, as oneDNN sums
    fallback: Callable  # vLLM's own cpu_linear for this layer
    weight: torch.Tensor  # what vLLM passes its cpu_linear (may be empty)


# Routed layers by handle. The compiled graph reads a layer's handle from a
# tensor at run time (as vLLM does for its oneDNN handler), so a graph loaded
# from the compile cache calls this process's layers; an entry goes when its
# layer is garbage-collected (tests start many engines in one process).
_layers: dict[int, _Layer] = {}
_next = itertools.count()
# (K, N) -> blocks equal to oneDNN per row count, or None (refused)
_checked: dict[tuple[int, int], Optional[tuple[int, ...]]] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def ensure_loaded() -> bool:
    """Build (once per machine) and load the kernel; False, with a warning
    logged once, when it cannot be used (oneDNN then does every call)."""
    global _lib, _tried, _error
    if not enabled():
        return False
    with _lock:
        if not _tried:
            _tried = True
            _error = _build.load_or_warn(_open, "the CPU linear kernel",
                                         "vLLM's oneDNN runs every linear layer (same results)")
    return _lib is not None


def _open() -> None:
    global _lib
    _lib = open_library(build())


def build(cache_dir: str | None = None, march: str = _build.MARCH) -> str:
    """This machine's build of the kernel (``march``: another instruction
    set, for the tests' AVX2-only build)."""
    return _build.build(cache_dir, march, source=SOURCE, flags=FLAGS)


def open_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.specplug_linear_panel.restype = ctypes.c_int
    lib.specplug_linear_max_rows.restype = ctypes.c_int
    if lib.specplug_linear_max_rows() < MAX_ROWS:
        raise RuntimeError(f"{path} takes fewer than MAX_ROWS={MAX_ROWS} rows (a stale build?)")
    for fn in (lib.specplug_linear_pack, lib.specplug_linear):
        fn.restype = None
    lib.specplug_linear_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p]
    lib.specplug_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_int64]
    return lib


def panel() -> int:
    return _lib.specplug_linear_panel()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 into the kernel's panels."""
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty(n * k, dtype=torch.float32)
    _lib.specplug_linear_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, block: int = 0) -> torch.Tensor:
    """x [M, K] float32 (M <= MAX_ROWS) @ the packed weight's transpose ->
    [M, N], summing k in blocks of ``block`` (0: one chain)."""
    x = x.contiguous()
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the CPU linear kernel takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    _lib.specplug_linear(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n,
                         y.data_ptr(), block)
    return y


def _forward(x: torch.Tensor, handle: torch.Tensor, n: int,
             bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A routed layer's forward: the kernel for 1..MAX_ROWS float32 rows,
    vLLM's own path otherwise."""
    layer = _layers[int(handle)]
    if 0 < x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.dtype == torch.float32 \
            and bias is None:
        return matmul(x, layer.packed, n, layer.blocks[x.shape[0] - 1])
    return layer.fallback(x, layer.weight, bias)


# A torch op, so that the compiled graph calls it as it calls onednn_mm.
# Defined with torch.library.Library rather than the custom_op decorator:
# the decorator's wrappers cost ~35 us a call on a 2-core CPU, ~3 ms a step over the
# reference model's 91 routed calls; this costs ~8 us.
_LIB = torch.library.Library("specplug", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor handle, int n, Tensor? bias) -> Tensor")
_LIB.impl("cpu_linear", _forward, "CPU")


@torch.library.register_fake("specplug::cpu_linear", lib=_LIB)
def _(x: torch.Tensor, handle: torch.Tensor, n: int,
      bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)


class _Handle:
    """What a routed layer's ``cpu_linear`` closes over: its handle in a
    tensor, so that dynamo reads it at run time instead of baking it in."""

    def __init__(self, handle: int) -> None:
        self.tensor = torch.tensor(handle, dtype=torch.int64)


# Random inputs per row count the order check tries. One is not enough: a
# wrong block size can match oneDNN's bits on one input and differ in the
# last bit on others. On an Intel Xeon with AVX-512/AMX, oneDNN sums
# K = 1536 in blocks of 512 at one row and 1024 at more; with one input per
# row count a block that matched neither could pass the check.
ORDER_TRIALS = 4


def _equal_at(fallback: Callable, weight: torch.Tensor, packed: torch.Tensor,
              n: int, k: int, m: int, block: int) -> bool:
    g = torch.Generator().manual_seed(1234 + m)
    for trial in range(ORDER_TRIALS):
        x = torch.randn(m, k, generator=g) * (1.0 + trial)
        x[0] *= torch.logspace(-6, 6, k)
        if not torch.equal(fallback(x, weight, None), matmul(x, packed, n, block)):
            return False
    return True


def sum_blocks(fallback: Callable, weight: torch.Tensor, packed: torch.Tensor, n: int,
               k: int) -> Optional[tuple[int, ...]]:
    """For each row count 1..``MAX_ROWS``, the first block size of
    ``SUM_BLOCKS`` with which the kernel gives ``fallback``'s bits
    (``ORDER_TRIALS`` random inputs, including a row of large and tiny
    magnitudes); None when some row count matches none (the shape stays on
    oneDNN). Checked once per shape: the order of oneDNN's sums depends on
    the shape and the rows, not on the weights' values."""
    if (k, n) not in _checked:
        found: list[int] = []
        for m in range(1, MAX_ROWS + 1):
            block = next((b for b in SUM_BLOCKS
                          if not 0 < k <= b  # a block covering K is one chain: 0, tried first
                          and _equal_at(fallback, weight, packed, n, k, m, b)), None)
            if block is None:
                break
            found.append(block)
        _checked[(k, n)] = tuple(found) if len(found) == MAX_ROWS else None
    return _checked[(k, n)]


def route(layer: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Send ``layer``'s small calls to the kernel if it qualifies (float32,
    no bias, N a multiple of the panel, bitwise equal to ``layer.cpu_linear``
    which vLLM just set up from ``weight``); True when routed."""
    if not ensure_loaded() or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if getattr(layer, "bias", None) is not None or getattr(layer, "cpu_linear", None) is None:
        return False
    n, k = weight.shape
    if n % panel() != 0 or weight.device.type != "cpu" \
            or ((k, n) in _checked and _checked[(k, n)] is None):
        return False
    packed = pack(weight)
    fallback = layer.cpu_linear
    blocks = sum_blocks(fallback, layer.weight, packed, n, k)
    if blocks is None:
        return False
    handle = next(_next)
    # detached: a weight vLLM keeps (the tied embedding / LM head) is a
    # Parameter whose ``weight_loader`` is a bound method of the layer; kept
    # as is, it held the layer alive from this global table, so the
    # finalizer below never ran and every engine left its LM head's copies
    # behind (~0.4 GB each on the reference model: a process that starts
    # many engines, as the tests do, would run out of memory)
    _layers[handle] = _Layer(packed, blocks, fallback, layer.weight.detach())
    weakref.finalize(layer, _layers.pop, handle, None)
    h = _Handle(handle)
    layer.cpu_linear = lambda x, w, bias: torch.ops.specplug.cpu_linear(x, h.tensor, n, bias)
    _routed.append(f"{k}x{n}")
    return True


_routed: list[str] = []  # shapes of the layers routed since the last take_routed()


def take_routed() -> list[str]:
    """The shapes (K x N) of the layers routed since the last call, in load
    order: what one model load routed (the compile cache's key includes it,
    so a graph with the kernel's op is never loaded where it is not routed)."""
    out = list(_routed)
    _routed.clear()
    return out
