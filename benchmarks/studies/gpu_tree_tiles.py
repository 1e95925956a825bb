"""Tile sizes of the Triton tree attention on a GPU: which query tokens per
program, keys per tile and warps are fastest at verification-step shapes.

    python -m benchmarks.studies.gpu_tree_tiles --out benchmarks/results/gpu_tree_tiles_h200.json

Needs a CUDA device, torch and Triton (no vLLM). Every configuration is
first checked against the torch reference (compiling in worker processes),
then timed with CUDA events (median of 20) in one pass and split KV, beside
torch SDPA with the same mask on K/V gathered beforehand. It chose
``tile_rows`` and ``tile_keys`` in ``vllm_specplug/kernels/tree_attention.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time

import torch

from benchmarks import result_file

SHAPES = {  # requests, nodes per tree, context, head_dim, q heads per kv head, kv heads
    "busy_32x64_ctx2048": (32, 64, 2048, 128, 4, 8),
    "long_1x16_ctx16384": (1, 16, 16384, 128, 4, 8),
    "mid_8x16_ctx1024": (8, 16, 1024, 128, 4, 8),
    "many_64x8_ctx512": (64, 8, 512, 128, 4, 8),
    "gqa8_16x32_ctx2048": (16, 32, 2048, 128, 8, 8),
    "mha_32x64_ctx2048_hd64": (32, 64, 2048, 64, 1, 16),
}
# block_q None: 16 tile rows (16 // qpk tokens, the kernel's former default)
CONFIGS = [dict(block_q=bq, block_n=bn, num_warps=w)
           for bq in (None, 8, 16, 32, 64) for bn in (32, 64) for w in (4, 8)]


def launch_args(shape: str, cfg: dict) -> dict:
    qpk = SHAPES[shape][4]
    return dict(cfg, block_q=cfg["block_q"] or max(1, 16 // qpk))


def fits(shape: str, cfg: dict) -> bool:
    return launch_args(shape, cfg)["block_q"] * SHAPES[shape][4] <= 128


def batch_for(shape: str):
    from vllm_specplug.kernels import check

    reqs, nodes, ctx, head_dim, qpk, kv_heads = SHAPES[shape]
    rng = random.Random(4)
    specs = [(ctx, check.random_parents(nodes, rng), nodes) for _ in range(reqs)]
    return specs, check.attention_batch(specs, head_dim, qpk, kv_heads, 16, "NHD",
                                        torch.bfloat16, "cuda", 5)


def verify(job) -> tuple:
    from vllm_specplug.kernels import check
    from vllm_specplug.kernels.tree_attention import tree_attention_ref, tree_attention_triton

    shape, i = job
    _, batch = batch_for(shape)
    want = tree_attention_ref(**batch)
    verdicts = []
    for segments in (1, None):
        try:
            got = tree_attention_triton(**batch, num_segments=segments,
                                        max_context_len=SHAPES[shape][2] + 1,
                                        **launch_args(shape, CONFIGS[i]))
            verdicts.append(check.compare(got, want, torch.bfloat16)["ok"])
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit
            verdicts.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    return shape, i, verdicts


def time_shape(shape: str, verdicts: dict) -> list[dict]:
    import torch.nn.functional as F

    from vllm_specplug.kernels import check
    from vllm_specplug.kernels.tree_attention import tree_attention_triton

    specs, batch = batch_for(shape)
    dq, dk, dv, mask = check.dense_sdpa_inputs(batch, specs)
    sdpa_ms = check.cuda_ms(lambda: F.scaled_dot_product_attention(
        dq, dk, dv, attn_mask=mask, scale=batch["scale"]))
    out, rows = torch.empty_like(batch["q"]), []
    for i, cfg in enumerate(CONFIGS):
        if not fits(shape, cfg):
            continue
        args = launch_args(shape, cfg)
        row = {"shape": shape, **args, "tile_rows": args["block_q"] * SHAPES[shape][4],
               "ok": verdicts[(shape, i)], "sdpa_ms": sdpa_ms}
        if all(v is True for v in row["ok"]):
            row["ms"] = check.cuda_ms(lambda: tree_attention_triton(**batch, out=out, **args))
            row["split_ms"] = check.cuda_ms(lambda: tree_attention_triton(
                **batch, out=out, num_segments=None, max_context_len=SHAPES[shape][2] + 1,
                **args))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_tree_tiles.json")
    p.add_argument("--jobs", type=int, default=14, help="worker processes that compile")
    args = p.parse_args(argv)
    jobs = [(s, i) for s in SHAPES for i, c in enumerate(CONFIGS) if fits(s, c)]
    t0 = time.time()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        verdicts = {(s, i): v for s, i, v in pool.map(verify, jobs, chunksize=1)}
    compile_s = time.time() - t0
    rows = [row for shape in SHAPES for row in time_shape(shape, verdicts)]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shapes": SHAPES, "compile_s": round(compile_s, 1), "rows": rows}
    result_file.write(doc, args.out)
    bad = [r for r in rows if not all(v is True for v in r["ok"])]
    print(f"{len(rows)} configurations, {len(bad)} wrong; report in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
