"""Dense datastore for DReSD (Gritta et al., 2025, "Dense Retrieval for
Speculative Decoding").

A key-value store ``f: k -> v``: the key is the target model's last hidden
state (the input of the LM head, i.e. after the final norm) at a corpus
position ``t``, the value the next ``N`` tokens ``x_{t+1} .. x_{t+N}``
(``-1``-padded at the end of a document). ``x_{t+1}`` is the token that
hidden state predicts; at inference it filters the drafts (the token the
target just sampled must match) and is then stripped.

Keys are stored reduced, as in the paper:

1. z-score (Eq. 1): ``(v - E[V]) / sqrt(Var[V] + eps)``, statistics from up to
   ``max_sample`` (~1M) keys drawn uniformly from the store;
2. PCA to ``dims`` (64) components fitted on the same sample (the z-scored
   sample has zero mean, so the projection is ``z @ W``);
3. L2 normalisation (Eq. 2): ``v / max(||v||, eps)``, so ScaNN's dot product
   is the cosine similarity (Eq. 3).

On disk (``.npy`` only, no pickle)::

    manifest.json            written last; checksums of every file below
    zscore_mean.npy [H]      float32
    zscore_std.npy  [H]      float32, sqrt(Var + eps)
    pca_components.npy [H, dims] float32 (columns = principal axes)
    pca_explained_variance.npy [dims] float64 (of the z-scored sample)
    keys.npy [n, dims]       float32, reduced + unit norm (the index input)
    values.npy [n, N]        int32, next N tokens, -1 padded
    doc_offsets.npy [docs+1] int64, first key of every document
    raw_keys.npy [n, H]      only with keep_raw_keys
    responses.jsonl          only in in-distribution mode
    scann/                   the serialized ScaNN searcher (relative paths)

Built by ``vllm_specplug.datastore.build`` (the offline side: corpus,
target forward, PCA, ScaNN); this module is what serving loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

__all__ = [
    "DatastoreError",
    "DenseDatastore",
    "MANIFEST_FILE",
    "tokenizer_fingerprint",
    "transform_hidden",
]

MANIFEST_FILE = "manifest.json"
FORMAT = "specplug-dense-datastore"
FORMAT_VERSION = 1

ZSCORE_EPS = 1e-5
_SMALL_BATCH = 64
L2_EPS = 1e-12


class DatastoreError(ValueError):
    """A datastore problem; the message is one line."""


def _log(msg: str) -> None:
    print(f"[vllm_specplug.datastore] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Tokenizer fingerprint
# ---------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer_or_path: Any) -> str:
    """A hash identifying a tokenizer's token -> id mapping.

    ``"vocab-sha256:<hex>"``: SHA-256 of the canonical JSON of the full
    vocabulary (added tokens included), so two tokenizers that map every
    string to the same ids agree even if their files differ in formatting.
    Falls back to ``"file-sha256:<hex>"`` of ``tokenizer.json`` when the
    tokenizer cannot be loaded.
    """
    tok = tokenizer_or_path
    if isinstance(tok, (str, os.PathLike)):
        path = os.fspath(tok)
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - fall back to the file hash
            tj = os.path.join(path, "tokenizer.json")
            if os.path.isfile(tj):
                return "file-sha256:" + _sha256_file(tj)
            raise DatastoreError(
                f"cannot load tokenizer at {path}: {type(e).__name__}: {e}".replace("\n", " ")
            ) from None
    vocab = tok.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])),
                      ensure_ascii=False, separators=(",", ":"))
    return "vocab-sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# The key transform (z-norm -> PCA -> L2)
# ---------------------------------------------------------------------------


def transform_hidden(hidden: np.ndarray, mean: np.ndarray, std: np.ndarray,
                     components: np.ndarray) -> np.ndarray:
    """``[B, H]`` hidden states -> ``[B, dims]`` unit-norm float32 keys."""
    z = (np.asarray(hidden, dtype=np.float32) - mean) / std
    if z.shape[0] <= _SMALL_BATCH:
        # Query-time sizes: a plain loop (einsum without BLAS) in this thread.
        # Multi-threaded BLAS on a [B, H] x [H, 64] product costs more in
        # thread wake-ups than in arithmetic (ms instead of us on a busy CPU)
        # and its spinning threads would compete with the target's forward.
        v = np.einsum("bh,hd->bd", z, components, optimize=False)
    else:
        v = z @ components
    norm = np.linalg.norm(v, axis=1, keepdims=True)
    return (v / np.maximum(norm, L2_EPS)).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------
# Loading and querying
# ---------------------------------------------------------------------------


class DenseDatastore:
    """A built dense datastore, verified and ready to query."""

    def __init__(self, path: str, manifest: dict, mean, std, components, keys, values,
                 doc_offsets, searcher) -> None:
        self.path = path
        self.manifest = manifest
        self.mean = mean
        self.std = std
        self.components = components
        self.keys = keys
        self.values = values
        self.doc_offsets = doc_offsets
        self.searcher = searcher
        self.index = manifest["index"]

    # -- facts ---------------------------------------------------------------
    @property
    def n_next(self) -> int:
        return int(self.manifest["n_next"])

    @property
    def dims(self) -> int:
        return int(self.manifest["dims"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def __len__(self) -> int:
        return int(self.manifest["counts"]["keys"])

    # -- open ----------------------------------------------------------------
    @classmethod
    def open(cls, path: str, *, expect_hidden_size: int | None = None,
             expect_vocab_size: int | None = None, expect_tokenizer_hash: str | None = None,
             verify_checksums: bool = True) -> DenseDatastore:
        """Open and verify a store. Every failure is a one-line
        :class:`DatastoreError`: missing store/file, corrupted file (size or
        checksum), unsupported format, or a hidden size / vocab size /
        tokenizer that differs from the target's."""
        path = os.path.abspath(os.path.expanduser(path))
        where = f"dense datastore {path}"
        if not os.path.isdir(path):
            raise DatastoreError(f"{where}: no such directory")
        mpath = os.path.join(path, MANIFEST_FILE)
        if not os.path.isfile(mpath):
            raise DatastoreError(f"{where}: missing file '{MANIFEST_FILE}' (not a dense "
                                 f"datastore or an unfinished build)")
        try:
            with open(mpath, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise DatastoreError(f"{where}: corrupted file '{MANIFEST_FILE}' ({e})".replace(
                "\n", " ")) from None
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise DatastoreError(
                f"{where}: unsupported format {manifest.get('format')!r} "
                f"v{manifest.get('format_version')!r} (expected {FORMAT} v{FORMAT_VERSION})")
        files = manifest.get("files", {})
        for name in ("zscore_mean.npy", "zscore_std.npy", "pca_components.npy", "keys.npy",
                     "values.npy", "doc_offsets.npy"):
            if name not in files:
                raise DatastoreError(f"{where}: manifest lists no '{name}'")
        for name, info in sorted(files.items()):
            p = os.path.join(path, name)
            if not os.path.isfile(p):
                raise DatastoreError(f"{where}: missing file '{name}'")
            size = os.path.getsize(p)
            if size != info["bytes"]:
                raise DatastoreError(f"{where}: corrupted file '{name}' (size {size} bytes, "
                                     f"manifest says {info['bytes']})")
            if verify_checksums and _sha256_file(p) != info["sha256"]:
                raise DatastoreError(f"{where}: corrupted file '{name}' (sha256 mismatch)")
        model = manifest.get("model", {}).get("id", "?")
        if expect_hidden_size is not None and int(manifest["hidden_size"]) != expect_hidden_size:
            raise DatastoreError(
                f"{where}: hidden size mismatch: built for {manifest['hidden_size']} "
                f"(model {model}), target has {expect_hidden_size}")
        if expect_vocab_size is not None and int(manifest["vocab_size"]) != expect_vocab_size:
            raise DatastoreError(
                f"{where}: vocab size mismatch: built for {manifest['vocab_size']} "
                f"(model {model}), target has {expect_vocab_size}")
        if expect_tokenizer_hash is not None and manifest["tokenizer_hash"] != expect_tokenizer_hash:
            raise DatastoreError(
                f"{where}: tokenizer mismatch: built with {manifest['tokenizer_hash'][:28]}... "
                f"(model {model}), target tokenizer is {expect_tokenizer_hash[:28]}...")

        def load(name, mmap=False):
            try:
                return np.load(os.path.join(path, name), mmap_mode="r" if mmap else None,
                               allow_pickle=False)
            except Exception as e:  # noqa: BLE001
                raise DatastoreError(f"{where}: corrupted file '{name}' ({type(e).__name__})"
                                     ) from None

        mean = load("zscore_mean.npy")
        std = load("zscore_std.npy")
        comps = load("pca_components.npy")
        keys = load("keys.npy", mmap=True)
        values = load("values.npy", mmap=True)
        offsets = load("doc_offsets.npy")
        h, d, n, nn = (int(manifest["hidden_size"]), int(manifest["dims"]),
                       int(manifest["counts"]["keys"]), int(manifest["n_next"]))
        for name, arr, shape in (("zscore_mean.npy", mean, (h,)), ("zscore_std.npy", std, (h,)),
                                 ("pca_components.npy", comps, (h, d)),
                                 ("keys.npy", keys, (n, d)), ("values.npy", values, (n, nn))):
            if arr.shape != shape:
                raise DatastoreError(f"{where}: corrupted file '{name}' (shape {arr.shape}, "
                                     f"expected {shape})")
        try:
            import scann

            searcher = scann.scann_ops_pybind.load_searcher(
                os.path.join(path, "scann"), assets_backcompat_shim=False)
        except Exception as e:  # noqa: BLE001
            raise DatastoreError(f"{where}: cannot load the ScaNN index "
                                 f"({type(e).__name__}: {e})".replace("\n", " ")) from None
        return cls(path, manifest, mean, std, comps, keys, values, offsets, searcher)

    # -- query ---------------------------------------------------------------
    def embed(self, hidden: np.ndarray) -> np.ndarray:
        """z-norm -> PCA -> L2 of ``[B, H]`` hidden states."""
        hidden = np.asarray(hidden)
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden_size:
            raise DatastoreError(f"expected hidden states [B, {self.hidden_size}], "
                                 f"got {list(hidden.shape)}")
        return transform_hidden(hidden, self.mean, self.std, self.components)

    def search(self, queries: np.ndarray, k: int, *, leaves_to_search: int | None = None,
               pre_reorder_num_neighbors: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """ScaNN batched search of already-embedded queries -> ``(ids [B, k]
        int64, scores [B, k] float32)``, ``-1`` / ``-inf`` where fewer than
        ``k`` neighbours exist."""
        b = queries.shape[0]
        ids = np.full((b, k), -1, dtype=np.int64)
        scores = np.full((b, k), -np.inf, dtype=np.float32)
        if b == 0 or k <= 0:
            return ids, scores
        kw: dict[str, int] = {}
        kind = self.index["kind"]
        if kind == "tree_ah" and leaves_to_search is not None:
            kw["leaves_to_search"] = int(leaves_to_search)
        if kind in ("ah", "tree_ah"):
            kw["pre_reorder_num_neighbors"] = max(
                k, int(pre_reorder_num_neighbors or self.index["reorder"]))
        idx, dist = self.searcher.search_batched(
            np.ascontiguousarray(queries, dtype=np.float32), final_num_neighbors=k, **kw)
        idx = np.asarray(idx).astype(np.int64)
        dist = np.asarray(dist)
        m = min(k, idx.shape[1]) if idx.ndim == 2 else 0
        # ScaNN pads missing neighbours with id 0 and a NaN distance.
        ok = ~np.isnan(dist[:, :m])
        ids[:, :m] = np.where(ok, idx[:, :m], -1)
        scores[:, :m] = np.where(ok, dist[:, :m], -np.inf)
        return ids, scores

    def query(self, hidden: np.ndarray, k: int, **kw) -> tuple[np.ndarray, np.ndarray]:
        """``[B, H]`` hidden states -> ``(token_seqs [B, k, N] int32, scores
        [B, k] float32)``; token rows are ``-1`` where no neighbour exists."""
        ids, scores = self.search(self.embed(hidden), k, **kw)
        seqs = np.full(ids.shape + (self.n_next,), -1, dtype=np.int32)
        ok = ids >= 0
        if ok.any():
            flat = ids[ok]
            order = np.argsort(flat, kind="stable")
            rows = np.empty((flat.shape[0], self.n_next), dtype=np.int32)
            rows[order] = self.values[flat[order]]  # sorted reads on the memmap
            seqs[ok] = rows
        return seqs, scores
