"""One drafting level's GEMMs of the EAGLE-3 head, float32 against bfloat16
weights, on vLLM's CPU kernels.

    python -m benchmarks.head_gemm [--rows 1,4,10,20,40] [--repeats 40]

A level runs the head's decoder layer (q/k/v, o, gate/up, down; the
reference head's shapes by default) on a handful of rows. Between a
target's steps its weights leave the cache, so each pass is timed "cold"
(a 96 MB buffer is written before it) and "hot" (back to back). Prints
the median per level in ms.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from benchmarks.machine import describe, machine_info

SHAPES = {"qkv": (1152, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
"""(in, out) of the reference head's fused decoder layer (``eagle3/draft_layer.py``)."""


def _layers(dtype: torch.dtype) -> list[torch.nn.Linear]:
    from vllm_specplug.runner.cpu_gemm import prepare_cpu_linears

    layers = [torch.nn.Linear(k, n, bias=False) for k, n in SHAPES.values()]
    for layer in layers:
        prepare_cpu_linears(layer, weight_dtype=dtype)
    return layers


def _level_ms(layers: list[torch.nn.Linear], inputs: list[torch.Tensor], repeats: int,
              flush: torch.Tensor | None) -> float:
    times = []
    for _ in range(repeats + 5):  # the first calls build oneDNN's primitives
        if flush is not None:
            flush.mul_(1.0000001)
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            layer(x)
        times.append(time.perf_counter() - start)
    return median(times[5:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,10,20,40")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(describe(machine_info()))
    print("bfloat16 arithmetic:", torch.cpu._is_avx512_bf16_supported()
          or torch.cpu._is_amx_tile_supported())
    arms = {"float32": _layers(torch.float32), "bfloat16": _layers(torch.bfloat16)}
    flush = torch.randn(24 << 20)
    for rows in map(int, args.rows.split(",")):
        inputs = [torch.randn(rows, k) for k, _ in SHAPES.values()]
        cells = [f"{name} {state} {_level_ms(layers, inputs, args.repeats, buf):.3f}"
                 for state, buf in (("cold", flush), ("hot", None))
                 for name, layers in arms.items()]
        print(f"rows {rows:3d}: " + " | ".join(cells) + " ms")


if __name__ == "__main__":
    main()
