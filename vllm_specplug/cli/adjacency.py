"""`specplug adjacency`: build and inspect warm-start adjacency tables.

    specplug adjacency build --model DIR --corpus FILE --out FILE [--k 8] [--max-tokens N]
    specplug adjacency info FILE

The built file is what the ``recycle`` method's ``table_path`` option loads.
"""

from __future__ import annotations

import argparse


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "adjacency", help="build/inspect token adjacency tables (recycle method)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="adjacency_command", metavar="ACTION")

    build = sub.add_parser("build", help="fill a table from the target's top-k over a corpus")
    build.add_argument("--model", required=True, help="HF model folder (the target)")
    build.add_argument(
        "--corpus", required=True,
        help='.txt (one document per line) or .jsonl with "text", "prompt"/"turns" '
             '(+ "response"): see vllm_specplug.corpus',
    )
    build.add_argument("--out", required=True, help="output file (safetensors)")
    build.add_argument("--k", type=int, default=8, help="successors per token (default 8)")
    build.add_argument("--max-tokens", type=int, default=None, help="stop after N corpus tokens")
    build.add_argument("--batch-size", type=int, default=4, help="full windows per forward pass")
    build.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    build.add_argument("--device", default="cpu", help="torch device (default cpu)")
    build.set_defaults(func=_build)

    info = sub.add_parser("info", help="print a table file's header")
    info.add_argument("path")
    info.set_defaults(func=_info)

    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _build(args: argparse.Namespace) -> int:
    import os

    from vllm_specplug.sources.adjacency import build_from_corpus

    sizes = {"--k": args.k, "--batch-size": args.batch_size, "--seq-len": args.seq_len}
    for flag, value in sizes.items():
        if value < 1:
            raise SystemExit(f"specplug adjacency build: {flag} must be >= 1")
    table = build_from_corpus(
        args.model, args.corpus, k=args.k, max_tokens=args.max_tokens,
        batch_size=args.batch_size, seq_len=args.seq_len, device=args.device,
    )
    table.save(args.out, corpus=os.path.basename(args.corpus))
    print(
        f"wrote {args.out}: vocab {table.vocab_size} x k {table.k}, "
        f"{table.num_filled()} rows filled, {table.nbytes / 2**20:.1f} MiB"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from vllm_specplug.sources.adjacency import AdjacencyTable

    try:
        header = AdjacencyTable.read_header(args.path)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for key, value in sorted(header.items()):
        print(f"{key}: {value}")
    return 0
