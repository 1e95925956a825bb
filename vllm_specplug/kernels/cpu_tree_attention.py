"""The CPU tree attention as one native call per layer.

Why: on a CPU the tree rows' attention written as ATen calls
(``runner.tree_attention.paged_tree_attention``) costs about twenty calls a
layer, each ~8 us of dispatch on a 2-core machine, plus a copy of every
context block out of the paged cache; at batch 1 that overhead, not the
arithmetic, makes an 8-node tree step cost 1.5-1.9x a plain step. The kernel
in ``cpu_tree_attention.cpp`` reads the blocks where they lie, shares each
block's loads across all the rows of a kv head's group, and merges context
chunks flash-attention style, in one call.

How it is built: with the machine's own C++ compiler (``g++`` or ``$CXX``),
``-O3 -march=native -fopenmp``, on first use, into
``<cache>/kernels/<hash>.so``; the hash covers the source, the compiler
command and the CPU's flags, so another machine or compiler builds its own
copy. A build takes a couple of seconds; it runs once, at the worker's
start (``ensure_loaded``), never in a step. The library is loaded with
``ctypes`` and links to ``libgomp.so.1`` by name, so it shares the OpenMP
runtime (and threads) torch already loaded.

When the compiler is missing or the build fails, a warning says why and the
ATen path is used: slower, same results. ``SPECPLUG_CPU_TREE_KERNEL=0``
turns the kernel off (the benchmarks compare the two that way).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import torch

from vllm_specplug.kernels.cache_layout import cpu_split_cache
from vllm_specplug.paths import default_cache_dir

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_tree_attention.cpp")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
MARCH = "native"
"""The machine's own instruction set (AVX-512 where it has it, else AVX2 ...);
the tests also build ``x86-64-v3`` (AVX2, no AVX-512: an AMD EPYC before Zen 4)."""
ENV_SWITCH = "SPECPLUG_CPU_TREE_KERNEL"

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


class _Args(ctypes.Structure):
    """Mirrors ``struct Args`` in the C++ source (checked against its size)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_s0", ctypes.c_int64), ("q_s1", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("k_s0", ctypes.c_int64), ("k_s1", ctypes.c_int64),
        ("v_s0", ctypes.c_int64), ("v_s1", ctypes.c_int64),
        ("k_transposed", ctypes.c_int32),
        ("block_ids", ctypes.c_void_p),
        ("context_len", ctypes.c_int64), ("block_size", ctypes.c_int64),
        ("k_step", ctypes.c_void_p), ("v_step", ctypes.c_void_p),
        ("ks_s0", ctypes.c_int64), ("ks_s1", ctypes.c_int64),
        ("vs_s0", ctypes.c_int64), ("vs_s1", ctypes.c_int64),
        ("mask", ctypes.c_void_p), ("mask_s0", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("o_s0", ctypes.c_int64), ("o_s1", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("n", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64),
        ("D", ctypes.c_int64), ("m", ctypes.c_int64),
    ]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def loaded() -> bool:
    """Whether tree rows go through the kernel (built, self-checked, on)."""
    return _lib is not None and enabled()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def library_path(cache_dir: str | None = None, march: str = MARCH, source: str = SOURCE,
                 flags: tuple = FLAGS) -> str:
    """Where this machine's build of a kernel (this one by default; the
    linear kernel passes its own source and flags) lives, built or not."""
    cxx = os.environ.get("CXX", "g++")
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + repr((cxx, flags, march)).encode()
                             + _cpu_flags().encode())
    name = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir or default_cache_dir(), "kernels",
                        f"{name}-{march}-{key.hexdigest()[:16]}.so")


def build(cache_dir: str | None = None, march: str = MARCH, source: str = SOURCE,
          flags: tuple = FLAGS) -> str:
    """Compile a kernel for this machine (once; a no-op when the library is
    there). Concurrent builders each write a temporary file and rename it
    into place: the last rename wins and every copy is the same."""
    path = library_path(cache_dir, march, source, flags)
    if os.path.exists(path):
        return path
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler '{cxx}' on PATH (set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, f"-march={march}", "-o", tmp, source],
                              capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def ensure_loaded() -> bool:
    """Build (if needed) and load the kernel; False, with a warning logged
    once, when it cannot be used here. Safe to call from several threads."""
    global _lib, _tried, _error
    if not enabled():
        return False
    with _lock:
        if not _tried:
            _tried = True
            _error = load_or_warn(_open_checked, "the native CPU tree attention",
                                  "using the slower ATen path (same results)")
    return _lib is not None


def _open_checked() -> None:
    global _lib
    _lib = open_library(build())
    err = self_check()  # calls the kernel through _lib
    if err is not None:
        _lib = None
        raise RuntimeError(f"self-check failed: {err}")


def load_or_warn(load, what: str, instead: str) -> str | None:
    """Run ``load`` (build, open, check a native kernel); on any failure log
    once that ``what`` is not available and what runs ``instead``, and
    return the reason (None when it loaded). Shared by the native kernels:
    a missing compiler or a failed check must never stop the engine."""
    try:
        load()
        return None
    except Exception as e:  # noqa: BLE001 - any failure means: the fallback path
        from vllm.logger import init_logger

        init_logger(__name__).warning("specplug: %s is not available (%s); %s", what, e,
                                      instead)
        return str(e)


def open_library(path: str) -> ctypes.CDLL:
    """Load a build and check that its argument struct is the one described
    here (a stale or foreign library must not be called)."""
    lib = ctypes.CDLL(path)
    lib.specplug_tree_attention.restype = ctypes.c_int
    lib.specplug_tree_attention.argtypes = [ctypes.POINTER(_Args), ctypes.c_int,
                                            ctypes.c_int64]
    if lib.specplug_tree_attention_abi() != ctypes.sizeof(_Args):
        raise RuntimeError("argument struct size differs between C++ and Python")
    return lib


CHUNK_TOKENS = 512
"""At most this many context tokens per work item (whole blocks, at least
one): an item's scores (rows x tokens floats) stay in the core's L2 cache."""


def blocks_per_chunk(context_len: int, block_size: int, kv_heads: int) -> int:
    """Context blocks per work item: enough items for every thread to get
    several (the items are uneven at the context's end), no more than
    ``CHUNK_TOKENS`` tokens each, no fewer than one block."""
    nblk = max(1, -(-context_len // block_size))
    want = 4 * max(1, torch.get_num_threads())
    chunks = max(1, -(-want // kv_heads))
    per = -(-nblk // chunks)
    return max(1, min(per, CHUNK_TOKENS // block_size))


def tree_attention(q, k_cache, v_cache, block_ids, context_len: int, k_step, v_step,
                   mask, scale: float, layout: str, out) -> bool:
    """Write the tree rows' attention into ``out`` with the native kernel;
    False (nothing written) when it does not apply, and the caller takes the
    ATen path. Shapes as ``runner.tree_attention.paged_tree_attention``
    (``mask`` is the boolean ``[n, m]`` visibility, not the additive bias).
    """
    call = prepare(q, k_cache, v_cache, block_ids, context_len, k_step, v_step, mask,
                   scale, layout, out)
    return call is not None and call.run()


class Call:
    """One kernel call's arguments, kept so that the same rows of the next
    layer can be run by re-pointing them (``run_at``) instead of building
    them again: every layer of a step has the same shapes, strides, block
    ids, mask and context, only its tensors' addresses differ. Building the
    arguments costs more than the kernel at short contexts (about 50 us a
    layer inside an engine against 130 us of kernel at a 300-token context)."""

    __slots__ = ("args", "dtype", "chunk", "keep")

    def __init__(self, args: _Args, dtype: int, chunk: int, keep) -> None:
        self.args, self.dtype, self.chunk = args, dtype, chunk
        self.keep = keep  # the mask bytes the arguments point at

    def run(self) -> bool:
        return _lib.specplug_tree_attention(ctypes.byref(self.args), self.dtype,
                                            self.chunk) == 0

    def run_at(self, q: int, k_cache: int, v_cache: int, block_ids: int, k_step: int,
               v_step: int, out: int) -> bool:
        """The same call on another layer's tensors (their addresses, laid out
        as the first layer's were: the caller checks the strides)."""
        a = self.args
        a.q, a.k_cache, a.v_cache, a.block_ids = q, k_cache, v_cache, block_ids
        a.k_step, a.v_step, a.out = k_step, v_step, out
        return self.run()


def prepare(q, k_cache, v_cache, block_ids, context_len: int, k_step, v_step, mask,
            scale: float, layout: str, out) -> Call | None:
    """``tree_attention``'s call, checked and built but not run; None when the
    kernel does not apply to these tensors."""
    if _lib is None or not enabled():
        return None
    dtype = _DTYPES.get(q.dtype)
    tensors = (q, k_cache, v_cache, k_step, v_step, out)
    if dtype is None or any(t.dtype != q.dtype or t.is_cuda for t in tensors):
        return None
    n, h, d = q.shape
    m, hkv = k_step.shape[0], k_step.shape[1]
    bs = k_cache.shape[2]
    # innermost dimensions contiguous where the kernel reads vectors
    if (q.stride(2) != 1 or out.stride(2) != 1 or k_step.stride(2) != 1
            or v_step.stride(2) != 1 or v_cache.stride(3) != 1 or v_cache.stride(2) != d
            or k_cache.stride(3) != 1 or k_cache.stride(2) != d or block_ids.dtype != torch.int32
            or not block_ids.is_contiguous()):
        return None
    mask_u8 = mask if mask.dtype == torch.uint8 and mask.stride(1) == 1 else \
        mask.to(torch.uint8).contiguous()
    a = _Args(
        q=q.data_ptr(), q_s0=q.stride(0), q_s1=q.stride(1),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        k_s0=k_cache.stride(0), k_s1=k_cache.stride(1),
        v_s0=v_cache.stride(0), v_s1=v_cache.stride(1),
        k_transposed=int(layout == "k_transposed"),
        block_ids=block_ids.data_ptr(), context_len=context_len, block_size=bs,
        k_step=k_step.data_ptr(), v_step=v_step.data_ptr(),
        ks_s0=k_step.stride(0), ks_s1=k_step.stride(1),
        vs_s0=v_step.stride(0), vs_s1=v_step.stride(1),
        mask=mask_u8.data_ptr(), mask_s0=mask_u8.stride(0),
        out=out.data_ptr(), o_s0=out.stride(0), o_s1=out.stride(1),
        scale=scale, n=n, H=h, Hkv=hkv, D=d, m=m,
    )
    return Call(a, dtype, blocks_per_chunk(context_len, bs, hkv), mask_u8)


def reference(q, k_cache, v_cache, block_ids, context_len: int, k_step, v_step, mask,
              scale: float, layout: str) -> torch.Tensor:
    """The same attention from first principles (float64, one softmax per
    node over [context | visible step rows]): the self-check's and the
    tests' yardstick, independent of both implementations."""
    n, h, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    rep = h // hkv
    keys, vals = [], []
    for pos in range(context_len):
        blk = int(block_ids[pos // bs])
        t = pos % bs
        if layout == "k_transposed":
            kb = k_cache[blk].reshape(hkv, d, bs)[:, :, t]
        else:
            kb = k_cache[blk, :, t]
        keys.append(kb)
        vals.append(v_cache[blk, :, t])
    kc = torch.stack(keys).double() if keys else torch.zeros(0, hkv, d, dtype=torch.float64)
    vc = torch.stack(vals).double() if vals else torch.zeros(0, hkv, d, dtype=torch.float64)
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        vis = mask[i].bool()
        k = torch.cat([kc, k_step[vis].double()])
        v = torch.cat([vc, v_step[vis].double()])
        for head in range(h):
            g = head // rep
            w = torch.softmax(k[:, g] @ q[i, head].double() * scale, dim=0)
            out[i, head] = w @ v[:, g]
    return out


def self_check() -> str | None:
    """One small problem per layout, against ``reference``: a compiler or
    CPU that miscompiles the kernel must not corrupt a single token. None
    when it passes, else what differed."""
    g = torch.Generator().manual_seed(0)
    n, h, hkv, d, bs, nb = 5, 4, 2, 32, 32, 4
    ctx = 2 * bs + 7
    mask = torch.zeros(n, n + 1, dtype=torch.bool)
    parents = [-1, 0, 0, 1, -1]
    for i, p in enumerate(parents):
        mask[i, 0] = mask[i, i + 1] = True
        while p >= 0:
            mask[i, p + 1] = True
            p = parents[p]
    for layout in ("k_transposed", "plain"):
        kv = torch.randn(nb, hkv, bs, 2 * d, generator=g)
        k_cache, v_cache = cpu_split_cache(kv)
        blocks = torch.tensor([3, 0, 2], dtype=torch.int32)
        q = torch.randn(n, h, d, generator=g)
        ks, vs = torch.randn(n + 1, hkv, d, generator=g), torch.randn(n + 1, hkv, d, generator=g)
        out = torch.full((n, h, d), float("nan"))
        if not tree_attention(q, k_cache, v_cache, blocks, ctx, ks, vs, mask, d ** -0.5,
                              layout, out):
            return f"{layout}: the kernel refused a supported call"
        want = reference(q, k_cache, v_cache, blocks, ctx, ks, vs, mask, d ** -0.5, layout)
        err = (out.double() - want).abs().max().item()
        if not err < 1e-4:
            return f"{layout}: max abs error {err}"
    return None
