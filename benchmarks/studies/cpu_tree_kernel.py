"""Per-layer cost of the CPU tree attention: the native kernel against the
ATen path it replaces, on random K/V in a paged cache of the reference
model's shape (9 heads, 3 kv heads, head 64, blocks of 128), float32.

    python -m benchmarks.studies.cpu_tree_kernel

Prints microseconds per layer call for contexts of 100/1000/4000 tokens and
trees of 8/32 nodes, with the machine's CPU. Time it alone (2-core machine).
"""

from __future__ import annotations

import time

import torch

from benchmarks.machine import describe, machine_info
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.kernels import cpu_tree_attention as native
from vllm_specplug.runner.tree_attention import cpu_split_cache, paged_tree_attention

H, HKV, D, BS = 9, 3, 64, 128


def _time(f, reps: int = 200) -> float:
    for _ in range(10):
        f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    if not native.ensure_loaded():
        raise SystemExit(f"native kernel unavailable: {native._error}")
    print(f"machine: {describe(machine_info())}; {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    for ctx in (100, 1000, 4000):
        for n in (8, 32):
            nb = (ctx + BS - 1) // BS + 2
            kc, vc = cpu_split_cache(torch.randn(nb, HKV, BS, 2 * D))
            blocks = torch.arange(nb, dtype=torch.int32).flip(0).contiguous()
            parents = [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary tree
            mask = torch.from_numpy(DraftTree(list(range(1, n + 1)), parents).ancestor_mask()[1:])
            bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
            mask_u8 = mask.to(torch.uint8).contiguous()
            q = torch.randn(n, H, D)
            ks, vs = torch.randn(n + 1, HKV, D), torch.randn(n + 1, HKV, D)
            out = torch.empty(n, H, D)
            a = _time(lambda: native.tree_attention(q, kc, vc, blocks, ctx, ks, vs, mask_u8,
                                                    D ** -0.5, "k_transposed", out))
            b = _time(lambda: paged_tree_attention(q, kc, vc, blocks, ctx, ks, vs, bias,
                                                   D ** -0.5, "k_transposed", out=out))
            print(f"context {ctx:5d}, {n:3d} nodes: native {a:7.1f} us/layer, "
                  f"ATen {b:7.1f} us/layer ({b / a:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
