"""`specplug datastore ...`: build and inspect retrieval datastores.

    specplug datastore build-dense --model DIR --corpus FILE --out DIR
    specplug datastore build-dense --suites humaneval:even --out DIR
    specplug datastore build-sa --model DIR --corpus FILE --out DIR
    specplug datastore build-sa --suites humaneval:even,specbench:qa --skip 16 --out DIR
    specplug datastore info DIR

``--suites`` stores the target's own greedy answers to a prompt suite's
prompts (:mod:`vllm_specplug.datastore.from_suites`) and writes their hashes
beside the store, so a benchmark never measures a method on prompts whose
answers its store holds; held-out evaluation suites are refused.

Heavy imports (torch, transformers, ScaNN) happen inside the commands.
"""

from __future__ import annotations

import argparse
import json
import sys


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "datastore", help="build and inspect retrieval datastores (dresd, reader)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="datastore_command", metavar="SUBCOMMAND")

    b = sub.add_parser(
        "build-dense",
        help="run the target over a corpus and build a DReSD dense datastore",
        description=(
            "Keys: the target's last hidden state (LM-head input) at every corpus "
            "position, z-scored, PCA-reduced and L2-normalised; values: the next N "
            "tokens. Index: ScaNN (brute force below 20k keys, AH + reorder below "
            "100k, tree + AH + reorder above). See vllm_specplug.datastore.build."))
    b.add_argument("--model", help="target model folder (Hugging Face format; default: "
                                   "the reference model)")
    b.add_argument("--corpus", help=".txt (one doc per line, or --txt-docs file) or .jsonl "
                                    "with a text/prompt/turns/response field")
    b.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    b.add_argument("--n-next", type=int, default=20, help="tokens per value (default 20)")
    b.add_argument("--dims", type=int, default=64, help="PCA dimensions (default 64)")
    b.add_argument("--max-sample", type=int, default=1_000_000,
                   help="keys sampled to fit z-score + PCA (default 1,000,000)")
    b.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per target forward pass; longer documents are windowed "
                        "with a KV cache (default 4096)")
    b.add_argument("--max-doc-tokens", type=int, default=1024,
                   help="truncate each document to this many tokens (default 1024, as the paper)")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the target runs in (keys are stored as float32)")
    b.add_argument("--in-distribution", metavar="PROMPTS_FILE",
                   help="also generate the target's greedy responses to these prompts "
                        "(.txt one per line or .jsonl prompt/turns/text) and store "
                        "prompt + response")
    b.add_argument("--max-new-tokens", type=int, default=128,
                   help="response length cap for --in-distribution and --suites (default 128)")
    b.add_argument("--gen-batch-size", type=int, default=8)
    b.add_argument("--txt-docs", choices=["line", "file"], default="line",
                   help="a .txt corpus is one document per line (default) or one document")
    b.add_argument("--index", choices=["auto", "brute_force", "ah", "tree_ah"], default="auto")
    b.add_argument("--reorder", type=int, default=256,
                   help="ScaNN exact-reordering candidates (AH indexes)")
    b.add_argument("--keep-raw-keys", action="store_true",
                   help="also keep the full-size hidden states (raw_keys.npy, n x H float32)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the target (default: torch's)")
    b.add_argument("--overwrite", action="store_true")
    b.add_argument("--no-progress", action="store_true")
    _add_suite_options(b, "the --in-distribution prompts")
    b.set_defaults(func=_build_dense)

    sa = sub.add_parser(
        "build-sa", help="build READER's token suffix-array datastore over a corpus",
        description=("Tokenize corpus files with the target's tokenizer and index them "
                     "with a suffix array (libdivsufsort); see "
                     "vllm_specplug.datastore.suffix_array."))
    sa.add_argument("--model", help="target model folder (its tokenizer; default: the "
                                    "reference model)")
    sa.add_argument("--corpus", action="append", default=[],
                    help=".txt (one doc per line, or --txt-docs file) or .jsonl with a "
                         "text/prompt/turns/response field; repeat for several files")
    sa.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    sa.add_argument("--txt-docs", choices=["line", "file"], default="line")
    sa.add_argument("--max-doc-tokens", type=int, default=None)
    sa.add_argument("--overwrite", action="store_true")
    sa.add_argument("--no-progress", action="store_true")
    sa.add_argument("--max-new-tokens", type=int, default=256,
                    help="answer length cap for --suites (default 256)")
    _add_suite_options(sa, "corpus documents (kept in OUT.answers.jsonl)")
    sa.set_defaults(func=_build_sa)

    i = sub.add_parser("info", help="verify a datastore (dense or suffix array) and print "
                                    "its manifest summary")
    i.add_argument("path")
    i.add_argument("--no-checksums", action="store_true", help="check sizes only")
    i.set_defaults(func=_info)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _add_suite_options(parser, what: str) -> None:
    parser.add_argument(
        "--suites", help=f"comma list of prompt suites (vllm_specplug.suites, e.g. "
                         f"humaneval:even,specbench:qa) whose greedy target answers become "
                         f"{what}; held-out evaluation suites are refused")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out each suite's first N prompts (e.g. the ones a "
                             "benchmark measures)")
    parser.add_argument("--limit", type=int, help="at most N prompts of each suite")


def _suite_names(args) -> list[str]:
    return [s.strip() for s in (args.suites or "").split(",") if s.strip()]


def _model(args, names: list[str]) -> str:
    """The target folder, after refusing held-out suites and a full --out
    (before minutes of answering prompts, not after)."""
    from vllm_specplug.datastore import from_suites
    from vllm_specplug.models.reference import reference_model_path

    if names:
        from_suites.check_suites(names)
        from_suites.check_out(args.out, args.overwrite)
    return args.model or reference_model_path()


def _build_dense(args) -> int:
    import tempfile

    from vllm_specplug.datastore import from_suites, prompt_list
    from vllm_specplug.datastore.build import build_dense_datastore
    from vllm_specplug.datastore.dense import DatastoreError

    names = _suite_names(args)
    if not args.corpus and not args.in_distribution and not names:
        return _usage("build-dense", "give --corpus, --in-distribution and/or --suites")
    if names and args.in_distribution:
        return _usage("build-dense", "--suites and --in-distribution both name the "
                                     "prompts; give one")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model, prompts, texts = _model(args, names), args.in_distribution, []
            if names:
                prompts = f"{tmp}/prompts.jsonl"
                texts = from_suites.write_prompts(prompts, model, names, skip=args.skip,
                                                  limit=args.limit,
                                                  max_new_tokens=args.max_new_tokens)
            m = build_dense_datastore(
                model, args.out, corpus=args.corpus, n_next=args.n_next,
                dims=args.dims, max_sample=args.max_sample, chunk_tokens=args.chunk_tokens,
                max_doc_tokens=args.max_doc_tokens, dtype=args.dtype,
                in_distribution=prompts, max_new_tokens=args.max_new_tokens,
                gen_batch_size=args.gen_batch_size, txt_docs=args.txt_docs,
                index=args.index, reorder=args.reorder, keep_raw_keys=args.keep_raw_keys,
                seed=args.seed, overwrite=args.overwrite, progress=not args.no_progress,
                num_threads=args.threads)
    except DatastoreError as e:
        return _failed("build-dense", e)
    if names:
        prompt_list.record(args.out, texts, names)
    print(json.dumps(_summary(m), indent=2))
    return 0


def _build_sa(args) -> int:
    from vllm_specplug.datastore import from_suites, prompt_list
    from vllm_specplug.datastore.dense import DatastoreError
    from vllm_specplug.datastore.suffix_array import build_sa_datastore

    names = _suite_names(args)
    if not args.corpus and not names:
        return _usage("build-sa", "give --corpus and/or --suites")
    corpus, texts = list(args.corpus), []
    try:
        model = _model(args, names)
        if names:
            answers, texts = from_suites.answers_corpus(
                model, args.out, names, skip=args.skip, limit=args.limit,
                max_new_tokens=args.max_new_tokens)
            corpus.append(answers)
        m = build_sa_datastore(model, args.out, corpus, txt_docs=args.txt_docs,
                               max_doc_tokens=args.max_doc_tokens,
                               overwrite=args.overwrite, progress=not args.no_progress)
    except DatastoreError as e:
        return _failed("build-sa", e)
    if names:
        prompt_list.record(args.out, texts, names)
    print(json.dumps(_sa_summary(m), indent=2))
    return 0


def _usage(command: str, message: str) -> int:
    print(f"specplug datastore {command}: {message}", file=sys.stderr)
    return 2


def _failed(command: str, error: Exception) -> int:
    print(f"specplug datastore {command}: {error}", file=sys.stderr)
    return 1


def _sa_summary(m: dict) -> dict:
    return {k: m[k] for k in ("format", "model", "vocab_size", "num_tokens",
                              "num_documents", "build_seconds")}


def _summary(m: dict) -> dict:
    return {
        "model": m["model"]["id"], "hidden_size": m["hidden_size"],
        "vocab_size": m["vocab_size"], "dims": m["dims"], "n_next": m["n_next"],
        "counts": m["counts"], "index": m["index"], "build_seconds": m["build_seconds"],
        "total_bytes": m["total_bytes"],
        "pca_explained_variance_ratio": m["transform"]["pca_explained_variance_ratio"],
    }


def _info(args) -> int:
    import os

    from vllm_specplug.datastore.dense import DatastoreError, DenseDatastore
    from vllm_specplug.datastore.suffix_array import FORMAT as SA_FORMAT
    from vllm_specplug.datastore.suffix_array import open_sa_datastore

    try:
        with open(os.path.join(args.path, "manifest.json"), encoding="utf-8") as f:
            is_sa = json.load(f).get("format") == SA_FORMAT
    except (OSError, ValueError):
        is_sa = False
    try:
        if is_sa:
            store = open_sa_datastore(args.path, verify_checksums=not args.no_checksums)
            print(json.dumps({**_sa_summary(store.manifest),
                              "manifest_sha256": store.manifest_sha256}, indent=2))
            return 0
        ds = DenseDatastore.open(args.path, verify_checksums=not args.no_checksums)
    except DatastoreError as e:
        print(f"specplug datastore info: {e}", file=sys.stderr)
        return 1
    print(json.dumps({**_summary(ds.manifest), "manifest_sha256": ds.manifest_sha256},
                     indent=2))
    return 0
