"""Cost of the shared adjacency table's two per-step operations.

    python -m benchmarks.studies.adjacency_cost [--batch 8] [--nodes 8] [--vocab 49152] [--k 8]

One update from ``batch * (nodes + 1)`` verified rows (what a step of
``batch`` requests with ``nodes``-node trees teaches the table) and one
expansion of the default 80-node template from ``batch`` roots, both on the
CPU path (torch ops, one thread). Prints median and 90th percentile.
"""

from __future__ import annotations

import argparse
import json
import time


def _timed(f, n: int) -> dict:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"median_ms": 1e3 * ts[len(ts) // 2], "p90_ms": 1e3 * ts[int(len(ts) * 0.9)]}


def main(argv: list[str] | None = None) -> dict:
    import torch

    from vllm_specplug.sources.adjacency import AdjacencyTable
    from vllm_specplug.methods.recycle import RecycleConfig

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    table = AdjacencyTable(args.vocab, args.k)
    rows = args.batch * (args.nodes + 1)
    for _ in range(100):  # a table that has seen traffic
        table.update(torch.randint(0, args.vocab, (rows,), generator=g),
                     torch.randint(0, args.vocab, (rows, args.k), generator=g))
    toks = torch.randint(0, args.vocab, (rows,), generator=g)
    topk = torch.randint(0, args.vocab, (rows, args.k), generator=g)
    roots = torch.randint(0, args.vocab, (args.batch,), generator=g)
    template = RecycleConfig(topk=args.k).build_template()
    out = {"batch": args.batch, "update_rows": rows, "table_mib": table.nbytes / 2**20,
           "update": _timed(lambda: table.update(toks, topk), args.repeats),
           "expand": _timed(lambda: template.expand(table, roots), args.repeats)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
