"""Kernel check kit: every Triton kernel against its torch reference.

    python -m vllm_specplug.kernels.check [--quick] [--out FILE] [--no-eagle3]

Needs only torch, triton and numpy (no vLLM), so it runs on a machine where
vLLM's CUDA build cannot be installed. It checks

* ``tree_attention`` over head_dim 64/128/256, GQA 1/4/8, trees of 1-64
  nodes beside causal rows, several requests per batch, block sizes 16/32,
  both in-memory orders of vLLM's layer cache (NHD and HND), float32,
  bfloat16 and float16, in one pass and split KV (3 slices), each against
  a per-dtype tolerance;
* ``kv_move`` (exact copies, overlapping and padded slot lists; one layer,
  and every layer in one launch pair) and the two ``adjacency`` kernels
  (exact), on the same grid of layouts;
* on CUDA only: times tree attention against masked torch SDPA and the KV
  move against a torch gather/scatter, and runs the EAGLE-3 head runtime's
  tree expansion on CUDA against CPU (``check_eagle3``).

It writes one JSON (``--out``) and exits 1 if any check missed. Without a GPU
set ``TRITON_INTERPRET=1`` (Triton's CPU interpreter; use ``--quick``: the
interpreter is slow at real shapes); without Triton the kernel checks are
reported as skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time

import torch

from vllm_specplug.kernels import INTERPRET_ON_CPU
from vllm_specplug.kernels.cache_layout import gpu_split_cache

# max |kernel - reference| <= atol + rtol * |reference|, per dtype: the
# kernel rounds its output to the dtype (bf16 keeps 8 mantissa bits).
TOLERANCE = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

FULL_GRID = dict(head_dims=(64, 128, 256), gqa=(1, 4, 8), kv_heads=2, block_sizes=(16, 32),
                 dtypes=("float32", "bfloat16", "float16"), layouts=("NHD", "HND"),
                 nodes=(1, 5, 17, 40, 64), contexts=(0, 37, 300, 1100))
QUICK_GRID = dict(head_dims=(32,), gqa=(1, 4), kv_heads=2, block_sizes=(16, 32),
                  dtypes=("float32", "bfloat16", "float16"), layouts=("NHD", "HND"),
                  nodes=(1, 5, 20), contexts=(0, 21))


# What Triton's CPU interpreter cannot check (left to a GPU run).
INTERPRETER_GAPS = ["tree_attention in bfloat16: the interpreter's tl.dot on "
                    "bfloat16 operands returns garbage (its loads and casts are right)"]


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a blocked or broken package
        return False


def triton_status() -> str | None:
    """None when the Triton kernels can run here, else why not."""
    if not importable("triton"):
        return "triton is not installed"
    if torch.cuda.is_available() or interpreted():
        return None
    return "no CUDA device and TRITON_INTERPRET is not 1"


def layer_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                layout: str, dtype, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of one vLLM layer cache, logical shape
    ``[blocks, kv_heads, block_size, 2*head]``, stored block-size-major
    (``NHD``) or head-major (``HND``), split as FLASH_ATTN/TRITON_ATTN do."""
    if layout == "NHD":
        phys = torch.randn(num_blocks, block_size, kv_heads, 2 * head_dim, generator=gen)
        logical = phys.to(dtype).to(device).permute(0, 2, 1, 3)
    else:
        phys = torch.randn(num_blocks, kv_heads, block_size, 2 * head_dim, generator=gen)
        logical = phys.to(dtype).to(device)
    return gpu_split_cache(logical, head_dim)


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(t) for t in range(1, n)]


def attention_batch(specs, head_dim, qpk, kv_heads, block_size, layout, dtype, device,
                    seed):
    """A varlen batch on a shuffled paged cache. ``specs``: per request
    ``(context_len, parents or None for causal rows, q_len)``."""
    from vllm_specplug.kernels.tree_attention import tree_mask_from_parents

    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, _, q in specs]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 2
    k_cache, v_cache = layer_cache(num_blocks, block_size, kv_heads, head_dim, layout,
                                   dtype, device, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(specs), max(per_seq) + 1, dtype=torch.int32)
    for s, nb in enumerate(per_seq):
        table[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    q_lens = [q for *_, q in specs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    masks = torch.zeros(sum(q_lens), dtype=torch.int64)
    is_tree = torch.zeros(len(specs), dtype=torch.bool)
    for s, (_, parents, _) in enumerate(specs):
        if parents is not None:
            masks[qsl[s]:qsl[s + 1]] = tree_mask_from_parents(parents)
            is_tree[s] = True
    q = torch.randn(sum(q_lens), kv_heads * qpk, head_dim, generator=gen).to(dtype)
    return dict(q=q.to(device), k_cache=k_cache, v_cache=v_cache,
                block_table=table.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=qsl.to(device), scale=head_dim ** -0.5,
                tree_mask=masks.to(device), is_tree=is_tree.to(device))


def attention_specs(grid: dict, rng: random.Random) -> list:
    """Several requests: a tree of every node count (random shapes, a chain
    and a star among them) on a random context, plus causal rows."""
    specs = []
    for i, n in enumerate(grid["nodes"]):
        shape = (list(range(-1, n - 1)) if i % 3 == 1 else
                 [-1] + [0] * (n - 1) if i % 3 == 2 else random_parents(n, rng))
        specs.append((rng.choice(grid["contexts"]), shape, n))
    specs.append((rng.choice(grid["contexts"]), None, 3))  # causal rows
    specs.append((max(grid["contexts"]) + 5, None, 1))  # plain decode row
    return specs


def compare(got: torch.Tensor, want: torch.Tensor, dtype) -> dict:
    atol, rtol = TOLERANCE[dtype]
    got, want = got.float().cpu(), want.float().cpu()
    err = (got - want).abs()
    excess = (err - atol - rtol * want.abs()).max().item()
    return {"max_abs_err": round(err.max().item(), 7), "atol": atol, "rtol": rtol,
            "ok": bool(excess <= 0 and torch.isfinite(got).all())}


def attention_combos(grid: dict) -> list[tuple]:
    """Every (head_dim, gqa, block_size, layout, dtype) the grid checks."""
    return [(head_dim, qpk, bs, layout, name) for head_dim in grid["head_dims"]
            for qpk in grid["gqa"] for bs in grid["block_sizes"]
            for layout in grid["layouts"] for name in grid["dtypes"]
            if not (name == "bfloat16" and interpreted())]  # see INTERPRETER_GAPS


def check_attention_case(grid: dict, index: int, combo: tuple, device) -> list[dict]:
    """One grid point: a batch of trees and causal rows, in one pass and
    split KV, against the reference. Seeded by its index in the grid, so a
    case draws the same batch however the grid is shared among workers."""
    from vllm_specplug.kernels.tree_attention import tree_attention_ref, tree_attention_triton

    head_dim, qpk, bs, layout, name = combo
    dtype, rng = DTYPES[name], random.Random(1000 + index)
    specs = attention_specs(grid, rng)
    batch = attention_batch(specs, head_dim, qpk, grid["kv_heads"], bs, layout, dtype, device,
                            rng.randrange(1 << 30))
    want = tree_attention_ref(**batch)
    results = []
    for segments in (1, 3):  # one pass, and split KV
        case = {"kernel": "tree_attention", "head_dim": head_dim, "gqa": qpk,
                "block_size": bs, "layout": layout, "dtype": name,
                "requests": len(specs), "segments": segments}
        try:
            got = tree_attention_triton(**batch, num_segments=segments)
        except Exception as exc:  # noqa: BLE001 - e.g. a tile Triton cannot fit: a miss
            results.append({**case, "error": f"{type(exc).__name__}: {exc}"[:500], "ok": False})
            continue
        results.append({**case, **compare(got, want, dtype)})
    return results


def _attention_case_job(args) -> list[dict]:
    return check_attention_case(*args)


def check_tree_attention(grid: dict, device, jobs: int = 1) -> list[dict]:
    """Every grid point; ``jobs`` > 1 shares them among worker processes
    (a full-size run is bound by Triton compiling each specialization)."""
    cases = [(grid, i, combo, device) for i, combo in enumerate(attention_combos(grid))]
    if jobs <= 1:
        return [row for case in cases for row in check_attention_case(*case)]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return [row for rows in pool.map(_attention_case_job, cases, chunksize=1)
                for row in rows]


def move_slots(num_slots: int, n: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlapping source and destination slots (shifts, chains, a swap),
    padded with -1 and a src == dst entry, as the runner hands them over."""
    base = rng.randrange(0, num_slots - 2 * n)
    dst = list(range(base, base + n))
    src = [d + rng.randrange(0, n) for d in dst]
    if n >= 2:
        src[0], src[1] = dst[1], dst[0]  # a swap
    src += [-1, dst[-1] + n + 1]
    dst += [-1, dst[-1] + n + 1]
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


def check_kv_move(grid: dict, device) -> list[dict]:
    """``kv_move`` on one layer's K and V, and ``kv_move_caches`` on three
    separately allocated layers' at once, against the torch reference."""
    from vllm_specplug.kernels.kv_move import kv_move_caches, kv_move_ref, kv_move_triton

    results, rng = [], random.Random(1)
    for head_dim in grid["head_dims"]:
        for bs in grid["block_sizes"]:
            for layout in grid["layouts"]:
                for name in grid["dtypes"]:
                    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
                    k, v = layer_cache(12, bs, grid["kv_heads"], head_dim, layout,
                                       DTYPES[name], device, gen)
                    src, dst = move_slots(12 * bs, max(grid["nodes"]) // 2 + 1, rng)
                    want_k, want_v = k.clone(), v.clone()
                    kv_move_ref(want_k, want_v, src.to(device), dst.to(device))
                    kv_move_triton(k, v, src.to(device), dst.to(device))
                    ok = torch.equal(k, want_k) and torch.equal(v, want_v)
                    results.append({"kernel": "kv_move", "head_dim": head_dim, "block_size": bs,
                                    "layout": layout, "dtype": name, "moved": len(src),
                                    "ok": bool(ok)})
                    views = [t for _ in range(3) for t in layer_cache(
                        12, bs, grid["kv_heads"], head_dim, layout, DTYPES[name], device, gen)]
                    want = [t.clone() for t in views]
                    for wk, wv in zip(want[::2], want[1::2]):
                        kv_move_ref(wk, wv, src.to(device), dst.to(device))
                    kv_move_caches(views, src.to(device), dst.to(device))
                    ok = all(torch.equal(a, b) for a, b in zip(views, want))
                    results.append({"kernel": "kv_move_caches", "head_dim": head_dim,
                                    "block_size": bs, "layout": layout, "dtype": name,
                                    "layers": 3, "moved": len(src), "ok": bool(ok)})
    return results


def check_adjacency(device) -> list[dict]:
    from vllm_specplug.kernels import adjacency as adj

    gen = torch.Generator().manual_seed(2)
    vocab, k = 1000, 8
    table = torch.randint(-1, vocab, (vocab, k), generator=gen, dtype=torch.int32).to(device)
    tokens = torch.randint(-1, vocab, (300,), generator=gen).to(device)  # repeats, -1 pads
    topk = torch.randint(0, vocab, (300, k), generator=gen, dtype=torch.int32).to(device)
    got, want = table.clone(), table.clone()
    adj.adjacency_update_triton(got, tokens, topk)
    adj.adjacency_update_ref(want, tokens, topk)
    results = [{"kernel": "adjacency_update", "ok": bool(torch.equal(got, want))}]
    parents = torch.tensor(random_parents(40, random.Random(3)), dtype=torch.int32)
    ranks = torch.randint(0, k + 1, (40,), generator=gen, dtype=torch.int32)  # k: out of range
    roots = torch.randint(-1, vocab, (16,), generator=gen).to(device)
    args = (want, roots, parents.to(device), ranks.to(device))
    same = torch.equal(adj.template_expand_triton(*args), adj.template_expand_ref(*args))
    results.append({"kernel": "template_expand", "ok": bool(same)})
    return results


# ------------------------------------------------------------------ timing (CUDA)


def cuda_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def dense_sdpa_inputs(batch: dict, specs) -> tuple:
    """The batch's requests as dense ``[B, H, L, D]`` q/k/v and a boolean
    visibility mask (padded to the longest), for torch SDPA."""
    from vllm_specplug.kernels.tree_attention import dense_visibility

    q, kc, vc, table = batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"]
    bs, qpk = kc.shape[1], q.shape[1] // kc.shape[2]
    lens = batch["seq_lens"].tolist()
    qsl = batch["query_start_loc"].tolist()
    n_max, l_max = max(q for *_, q in specs), max(lens)
    shape = (len(specs), q.shape[1], l_max, q.shape[2])
    dq = q.new_zeros(len(specs), q.shape[1], n_max, q.shape[2])
    dk, dv = q.new_zeros(shape), q.new_zeros(shape)
    mask = torch.zeros(len(specs), 1, n_max, l_max, dtype=torch.bool, device=q.device)
    for s, seq_len in enumerate(lens):
        pos = torch.arange(seq_len, device=q.device)
        blocks = table[s, pos // bs].long()
        dk[s, :, :seq_len] = kc[blocks, pos % bs].repeat_interleave(qpk, 1).transpose(0, 1)
        dv[s, :, :seq_len] = vc[blocks, pos % bs].repeat_interleave(qpk, 1).transpose(0, 1)
        n = qsl[s + 1] - qsl[s]
        dq[s, :, :n] = q[qsl[s]:qsl[s + 1]].transpose(0, 1)
        bits = batch["tree_mask"][qsl[s]:qsl[s + 1]]
        mask[s, 0, :n, :seq_len] = dense_visibility(seq_len, n, bits, q.device)
        mask[s, 0, n:, 0] = True  # padding rows see one key (no NaN rows)
    return dq, dk, dv, mask


def time_tree_attention(quick: bool) -> dict:
    """Tree attention vs torch SDPA with the same mask on pre-gathered dense
    K/V (SDPA's time excludes the gather it would need from the paged cache)."""
    import torch.nn.functional as F

    from vllm_specplug.kernels.tree_attention import tree_attention_triton

    shapes = [(4, 16, 200, 64, 4, 2)] if quick else \
        [(32, 64, 2048, 128, 4, 8), (1, 16, 16384, 128, 4, 8)]  # busy; one long request
    out_rows = []
    for reqs, nodes, ctx, head_dim, qpk, kvh in shapes:
        rng = random.Random(4)
        specs = [(ctx, random_parents(nodes, rng), nodes) for _ in range(reqs)]
        batch = attention_batch(specs, head_dim, qpk, kvh, 16, "NHD", torch.bfloat16, "cuda", 5)
        dq, dk, dv, mask = dense_sdpa_inputs(batch, specs)
        out = torch.empty_like(batch["q"])
        out_rows.append({
            "shape": {"requests": reqs, "nodes": nodes, "context": ctx, "head_dim": head_dim,
                      "q_heads": qpk * kvh, "kv_heads": kvh, "dtype": "bfloat16"},
            "tree_attention_ms": cuda_ms(lambda: tree_attention_triton(**batch, out=out)),
            "tree_attention_split_ms": cuda_ms(lambda: tree_attention_triton(
                **batch, out=out, num_segments=None, max_context_len=ctx + 1)),
            "sdpa_masked_ms": cuda_ms(lambda: F.scaled_dot_product_attention(
                dq, dk, dv, attn_mask=mask, scale=batch["scale"]))})
    return {"cases": out_rows}


def time_kv_move(quick: bool) -> dict:
    """The KV move of every layer (stacked 5-D cache: one launch pair per
    K and V; separate layer caches: one launch pair in all) vs torch
    advanced-indexing gather/scatter on the same slots."""
    from vllm_specplug.kernels.kv_move import (
        cache_table,
        kv_move_caches,
        kv_move_ref,
        kv_move_triton,
    )

    layers, blocks, bs, kvh, head_dim, moves = (2, 64, 16, 2, 64, 32) if quick else \
        (32, 4096, 16, 8, 128, 32 * 8)
    k = torch.randn(layers, blocks, bs, kvh, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rng = random.Random(6)
    src, dst = move_slots(blocks * bs, moves, rng)
    src, dst = src.cuda(), dst.cuda()
    views = [t for pair in zip(k.unbind(0), v.unbind(0)) for t in pair]
    table = cache_table(views)
    return {"shape": {"layers": layers, "moves": moves, "kv_heads": kvh, "head_dim": head_dim,
                      "dtype": "bfloat16"},
            "kv_move_ms": cuda_ms(lambda: kv_move_triton(k, v, src, dst)),
            "kv_move_caches_ms": cuda_ms(lambda: kv_move_caches(views, src, dst, table)),
            "torch_gather_scatter_ms": cuda_ms(lambda: kv_move_ref(k, v, src, dst))}


# ------------------------------------------------------------------ warm-up (CUDA)


def compiled_variants(kernel) -> int | None:
    """How many specializations of a ``@triton.jit`` kernel this process has
    compiled (or loaded from Triton's disk cache); None where this Triton
    keeps them where we do not look."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    cache = getattr(kernel, "cache", None)
    return sum(len(c) for c in cache.values()) if isinstance(cache, dict) else None


def serving_steps(rng: random.Random, steps: int = 40) -> list[list[tuple]]:
    """Tree-step batches as serving makes them: 1-7 requests, 1-40 nodes
    each (token counts divisible by 16 and equal to 1 among them), contexts
    short and long (split KV or not)."""
    batches = []
    for step in range(steps):
        reqs = 1 + step % 7
        batches.append([(rng.choice((5, 90, 700, 3000)), random_parents(n, rng), n)
                        for n in (1 + rng.randrange(40) for _ in range(reqs))])
    return batches


def check_warm_up(device, steps: int = 40) -> dict:
    """After ``warm_up_gpu_kernels`` on one layer's cache, serving-shaped
    tree steps and KV moves compile no new variant: none stalls for Triton
    mid-serving. Counts every kernel's compiled variants before and after."""
    from vllm_specplug.kernels import kv_move as kvm
    from vllm_specplug.kernels import tree_attention as ta
    from vllm_specplug.kernels.warm_up import warm_up_gpu_kernels

    kernels = {"tree_attention": ta._tree_attention_kernel,
               "merge_segments": ta._merge_segments_kernel,
               "kv_gather": kvm._kv_gather_kernel, "kv_scatter": kvm._kv_scatter_kernel}
    head_dim, kv_heads, qpk, bs, width, dtype = 128, 8, 4, 16, 256, torch.bfloat16
    cache = torch.randn(width * 8, kv_heads, bs, 2 * head_dim, device=device).to(dtype)
    t0 = time.time()
    warm_up_gpu_kernels(cache, head_dim, kv_heads * qpk, head_dim ** -0.5, width, dtype)
    sync(device)
    warm_s = time.time() - t0
    before = {name: compiled_variants(k) for name, k in kernels.items()}
    k_cache, v_cache = gpu_split_cache(cache, head_dim)
    rng, slowest_ms = random.Random(7), 0.0
    for specs in serving_steps(rng, steps):
        batch = attention_batch(specs, head_dim, qpk, kv_heads, bs, "NHD", dtype, device,
                                rng.randrange(1 << 30))
        table = torch.zeros(len(specs), width, dtype=torch.int32, device=device)
        table[:, :batch["block_table"].shape[1]] = batch["block_table"]
        batch.update(k_cache=k_cache, v_cache=v_cache, block_table=table)
        del batch["is_tree"]  # the runner's tree rows are all tree rows
        src, dst = move_slots(width * 8 * bs, 1 + rng.randrange(24), rng)
        t = time.time()
        tree_attention_triton_split(batch, max(c for c, *_ in specs))
        kvm.kv_move_triton(k_cache, v_cache, src.to(device), dst.to(device))
        sync(device)
        slowest_ms = max(slowest_ms, (time.time() - t) * 1e3)
    after = {name: compiled_variants(k) for name, k in kernels.items()}
    counted = all(v is not None for v in {**before, **after}.values())
    new = {name: after[name] - before[name] for name in kernels} if counted else None
    return {"kernel": "warm_up_covers_serving", "warm_up_s": round(warm_s, 2),
            "variants_after_warm_up": before, "new_variants_while_serving": new,
            "slowest_step_ms": round(slowest_ms, 2),
            # a Triton compile takes hundreds of ms: the step time is the
            # fallback where this Triton's variant count cannot be read
            "ok": bool(sum(new.values()) == 0 if counted else slowest_ms < 50)}


def sync(device) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tree_attention_triton_split(batch: dict, max_context_len: int) -> torch.Tensor:
    """The runner's call: split KV chosen from the host-known longest context."""
    from vllm_specplug.kernels.tree_attention import tree_attention_triton

    return tree_attention_triton(**batch, num_segments=None, max_context_len=max_context_len)


def guarded(report: dict, name: str, fn, *args):
    """``report[name] = fn(*args)``; an exception is recorded, not raised,
    so one broken section leaves the rest of the report."""
    try:
        report[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported, counted as a miss
        report[name] = {"error": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------------ the run


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "interpret": interpreted(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "vllm_importable": importable("vllm")}
    if importable("triton"):
        import triton

        info["triton"] = triton.__version__
    return info


def run_kernels(grid: dict, device, quick: bool, jobs: int) -> dict:
    report = {"checks": check_tree_attention(grid, device, jobs) + check_kv_move(grid, device)
              + check_adjacency(device)}
    if device == "cuda":
        guarded(report, "warm_up", check_warm_up, device)
        report["timing"] = {}
        guarded(report["timing"], "tree_attention", time_tree_attention, quick)
        guarded(report["timing"], "kv_move", time_kv_move, quick)
    else:
        report["timing"] = "skipped: no CUDA device (interpreter timings mean nothing)"
    return report


def misses(report: dict) -> list[dict]:
    """Every failed check and every section that raised."""
    failed = [c for c in report["checks"] if not c["ok"]]
    failed += [c for c in report.get("eagle3", {}).get("checks", []) if not c["ok"]]
    timing = report.get("timing")
    sections = [report.get("warm_up"), report.get("eagle3"),
                *(timing.values() if isinstance(timing, dict) else ())]
    for section in sections:
        if isinstance(section, dict) and ("error" in section or section.get("ok") is False):
            failed.append(section)
    return failed


def run(quick: bool, eagle3: bool, jobs: int = 1) -> dict:
    report = {"environment": environment(), "quick": quick}
    why = triton_status()
    if why is None:
        if interpreted():  # the kernels' dispatchers take the interpreter on CPU
            os.environ[INTERPRET_ON_CPU] = "1"
        device = "cuda" if torch.cuda.is_available() and not interpreted() else "cpu"
        report.update(run_kernels(QUICK_GRID if quick else FULL_GRID, device, quick, jobs))
        if interpreted():
            report["not_checked"] = INTERPRETER_GAPS
    else:
        report["checks"], report["kernels_skipped"] = [], why
    if eagle3:
        from vllm_specplug.kernels.check_eagle3 import check_eagle3

        guarded(report, "eagle3", check_eagle3, quick)
    report["failed"] = len(misses(report))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_specplug.kernels.check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (the CPU interpreter)")
    p.add_argument("--out", default="kernel_check.json", help="the JSON report")
    p.add_argument("--no-eagle3", action="store_true", help="skip the EAGLE-3 head check")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes for the tree-attention grid (compile-bound)")
    args = p.parse_args(argv)
    t0 = time.time()
    report = run(args.quick, not args.no_eagle3, args.jobs)
    report["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    checks = report["checks"] + report.get("eagle3", {}).get("checks", [])
    for c in misses(report):
        print("MISS", json.dumps(c), file=sys.stderr)
    print(f"{report['failed']} misses in {len(checks)} checks"
          + (f"; kernels skipped: {report['kernels_skipped']}" if "kernels_skipped" in report
             else "") + f"; report in {args.out}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
