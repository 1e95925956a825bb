"""READER's long-term datastore on disk: a token suffix array over a corpus.

    specplug datastore build-sa --model DIR --corpus FILE [--corpus FILE ...] --out DIR

A folder with ``tokens.npy`` (the corpus, documents joined by a separator
id), ``sa.npy`` (its suffix array, built by libdivsufsort) and
``manifest.json`` (format and version, the tokenizer's fingerprint, vocab
size, token and document counts, each file's size and SHA-256, the corpus it
came from). Serving reads both arrays into memory (about 6 to 8 bytes per
corpus token) and checks their checksums on those bytes, so a file changed on
disk later cannot reach a running server; only files the manifest lists are
read, and only from inside the folder (``vllm_specplug.datastore.manifest``).

Every fault a user can make is found when the store is opened, at engine
start-up, in one line naming the file: a missing folder or file, a truncated
or corrupt file, another format version, another tokenizer or vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable

import numpy as np

from vllm_specplug.corpus import CorpusError, iter_texts
from vllm_specplug.datastore.dense import (
    DatastoreError,
    _log,
    _sha256_file,
    tokenizer_fingerprint,
)
from vllm_specplug.datastore.manifest import (
    MANIFEST_FILE,
    check_pin,
    confined_path,
    npy_from_buffer,
    read_verified,
    refuse_pickles,
    sha256_hex,
)
from vllm_specplug.sources.suffix_array import (
    TokenSuffixArray,
    build_suffix_array,
    join_documents,
)

FORMAT = "specplug-suffix-array"
FORMAT_VERSION = 1
FILES = ("tokens.npy", "sa.npy")


def build_sa_datastore(model: str, out: str, corpus: Iterable[str], *,
                       txt_docs: str = "line", max_doc_tokens: int | None = None,
                       overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenize the corpus files with ``model``'s tokenizer and write a store
    to ``out``. Returns the manifest."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    corpus = list(corpus)
    if not corpus:
        raise DatastoreError("build-sa needs at least one --corpus file")
    if os.path.exists(out) and os.listdir(out):
        if not overwrite:
            raise DatastoreError(f"output folder {out} is not empty (use --overwrite)")
        shutil.rmtree(out)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    docs: list[list[int]] = []
    bar = tqdm(desc="tokenize", unit="doc", disable=not progress)
    try:
        for path in corpus:
            for text in iter_texts(path, tok, txt_docs=txt_docs):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if max_doc_tokens:
                    ids = ids[:max_doc_tokens]
                if ids:
                    docs.append(ids)
                bar.update(1)
    except CorpusError as e:
        raise DatastoreError(str(e)) from None
    bar.close()
    if not docs:
        raise DatastoreError(f"no documents in {', '.join(corpus)}")
    tokens = join_documents(docs, vocab)
    if progress:
        _log(f"suffix array over {tokens.size:,} tokens ...")
    sa = build_suffix_array(tokens)
    work = out.rstrip("/") + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    np.save(os.path.join(work, "tokens.npy"), tokens)
    np.save(os.path.join(work, "sa.npy"), sa)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": os.path.basename(os.path.normpath(model)),
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "vocab_size": vocab,
        "separator": vocab,
        "num_tokens": int(tokens.size),
        "num_documents": len(docs),
        "token_dtype": str(tokens.dtype),
        "sa_dtype": str(sa.dtype),
        "corpus": [os.path.abspath(p) for p in corpus],
        "files": {name: {"bytes": os.path.getsize(os.path.join(work, name)),
                         "sha256": _sha256_file(os.path.join(work, name))}
                  for name in FILES},
        "build_seconds": round(time.time() - t0, 2),
    }
    with open(os.path.join(work, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    if os.path.exists(out):
        os.rmdir(out)
    os.replace(work, out)
    return manifest


def open_sa_datastore(path: str, *, vocab_size: int | None = None,
                      tokenizer: str | None = None, verify_checksums: bool = True,
                      expect_manifest_sha256: str | None = None) -> TokenSuffixArray:
    """Open and check a store; every problem is a one-line DatastoreError.

    ``vocab_size`` / ``tokenizer`` (a tokenizer folder or fingerprint): what
    the serving model has; a store built for another is refused.
    ``expect_manifest_sha256``: the manifest digest checked before (the
    front end's); another manifest is refused. The arrays are read into
    memory; ``store.manifest_sha256`` is the manifest's digest."""
    if not os.path.isdir(path):
        raise DatastoreError(f"suffix-array datastore {path}: no such folder")
    where = f"suffix-array datastore {path}"
    manifest, digest = _read_sa_manifest(path)
    check_pin(digest, expect_manifest_sha256, where)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise DatastoreError(
            f"suffix-array datastore {path}: format {manifest.get('format')!r} "
            f"v{manifest.get('format_version')!r}, expected {FORMAT} v{FORMAT_VERSION} "
            "(rebuild it with `specplug datastore build-sa`)")
    if vocab_size is not None and manifest["vocab_size"] > vocab_size:
        raise DatastoreError(
            f"suffix-array datastore {path} was built for a vocabulary of "
            f"{manifest['vocab_size']} tokens, the model has {vocab_size}")
    if tokenizer is not None:
        fp = tokenizer if ":" in tokenizer else tokenizer_fingerprint(tokenizer)
        if fp != manifest["tokenizer_fingerprint"]:
            raise DatastoreError(
                f"suffix-array datastore {path} was built with another tokenizer "
                f"(model {manifest.get('model')!r}); rebuild it for this model")
    files = manifest["files"]
    refuse_pickles(files, where)
    for name in files:
        confined_path(path, name, where)
    for name in FILES:
        if name not in files:
            raise DatastoreError(f"{where}: manifest lists no '{name}'")
        fpath = os.path.join(path, name)
        if not os.path.isfile(confined_path(path, name, where)):
            raise DatastoreError(f"suffix-array datastore {fpath}: missing")
        if os.path.getsize(fpath) != files[name]["bytes"]:
            raise DatastoreError(
                f"suffix-array datastore {fpath}: {os.path.getsize(fpath)} bytes, "
                f"the manifest says {files[name]['bytes']} (truncated or replaced)")
    tokens, sa = (_read_array(path, name, files[name], verify_checksums) for name in FILES)
    if tokens.shape != (manifest["num_tokens"],) or sa.shape != tokens.shape:
        raise DatastoreError(f"suffix-array datastore {path}: array shapes disagree "
                             "with the manifest")
    store = TokenSuffixArray(tokens, sa, manifest["separator"])
    store.manifest = manifest
    store.manifest_sha256 = digest
    return store


def _read_sa_manifest(path: str) -> tuple[dict, str]:
    """The parsed manifest and the SHA-256 of its bytes."""
    where = f"suffix-array datastore {path}"
    mpath = os.path.join(path, MANIFEST_FILE)
    if not os.path.lexists(mpath):
        raise DatastoreError(f"{where}: manifest.json missing")
    raw = bytes(read_verified(confined_path(path, MANIFEST_FILE, where), where, MANIFEST_FILE))
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DatastoreError(f"suffix-array datastore {mpath}: not valid JSON") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise DatastoreError(f"suffix-array datastore {mpath}: not a manifest")
    return manifest, sha256_hex(raw)


def _read_array(path: str, name: str, info: dict, verify: bool) -> np.ndarray:
    """A listed array in memory, checked on the bytes kept."""
    fpath = os.path.join(path, name)
    where = f"suffix-array datastore {path}"
    try:
        buf = read_verified(confined_path(path, name, where), where, name,
                            nbytes=info["bytes"], sha256=info["sha256"] if verify else None)
    except DatastoreError as e:
        if "sha256 mismatch" in str(e):
            raise DatastoreError(f"suffix-array datastore {fpath}: checksum mismatch "
                                 "(corrupt)") from None
        raise
    return npy_from_buffer(buf, where, name)
