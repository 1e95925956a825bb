"""Build the DReSD datastore a benchmark run measures ``dresd`` with.

    python -m benchmarks.dresd_store --suite humaneval:even \\
        --out ~/.cache/vllm_specplug/dresd-humaneval-even

The store holds the target's own greedy answers to a suite's prompts (DReSD's
in-distribution setting), so ``dresd`` is measured on the other half of the
suite (``humaneval:odd``) without ever having seen those prompts. The prompts
are the suite's texts as the benchmark sends them (first turn, chat template);
``benchmarks/configs/cpu_reference.json`` points ``dresd`` at the default
output folder. An existing complete store is kept (``--overwrite`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    from benchmarks import store_prompts, suites
    from vllm_specplug.datastore.build import build_dense_datastore
    from vllm_specplug.datastore.dense import DatastoreError, DenseDatastore
    from vllm_specplug.models.reference import reference_model_path

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="humaneval:even")
    ap.add_argument("--out", default="~/.cache/vllm_specplug/dresd-humaneval-even")
    ap.add_argument("--model", help="target folder (default: the reference model)")
    ap.add_argument("--limit", type=int, help="first N prompts of the suite")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--n-next", type=int, default=20, help="tokens per stored value")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)

    out = os.path.expanduser(args.out)
    texts = suites.load(args.suite).texts[:args.limit]
    if os.path.exists(out) and not args.overwrite:
        try:
            DenseDatastore.open(out, verify_checksums=False)
            if not os.path.exists(store_prompts.list_path(out)):
                # benchmarks.run checks the store against the measured prompts
                store_prompts.record(out, texts, [args.suite])
            print(f"dresd store exists: {out} (--overwrite rebuilds it)")
            return 0
        except DatastoreError as e:
            print(f"{out} is not a usable store ({e}); pass --overwrite", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.jsonl")
        with open(prompts, "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"prompt": t}) + "\n")
        try:
            man = build_dense_datastore(
                args.model or reference_model_path(), out, in_distribution=prompts,
                max_new_tokens=args.max_new_tokens, n_next=args.n_next,
                overwrite=args.overwrite, num_threads=args.threads)
        except DatastoreError as e:
            print(f"benchmarks.dresd_store: {e}", file=sys.stderr)
            return 1
    store_prompts.record(out, texts, [args.suite])
    print(f"dresd store: {out} ({man['counts']}, {man['build_seconds']:.0f} s) from "
          f"{len(texts)} prompts of {args.suite}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
