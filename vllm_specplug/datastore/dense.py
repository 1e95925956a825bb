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

Serving reads only the files the manifest lists, into memory, checking each
one's SHA-256 on the bytes it keeps (``vllm_specplug.datastore.manifest``);
the ScaNN searcher is loaded from a private copy of the listed ``scann/``
files, so ScaNN never sees (or unpickles) anything else.

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

from vllm_specplug.datastore.manifest import (
    DatastoreError,
    check_pin,
    confined_path,
    copy_verified,
    hash_file,
    npy_from_buffer,
    read_verified,
    refuse_pickles,
    sha256_hex,
)

__all__ = [
    "DatastoreError",
    "DenseDatastore",
    "MANIFEST_FILE",
    "tokenizer_fingerprint",
    "transform_hidden",
]

MANIFEST_FILE = "manifest.json"
SCANN_DIR = "scann"
FORMAT = "specplug-dense-datastore"
FORMAT_VERSION = 1

ZSCORE_EPS = 1e-5
_SMALL_BATCH = 64
L2_EPS = 1e-12


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
    """A built dense datastore, verified and ready to query.

    Every array the queries use is in process memory (read once, checksum
    checked on those bytes); ``keys`` (only tools and tests read it) is read
    on first access."""

    def __init__(self, path: str, manifest: dict, mean, std, components, keys, values,
                 doc_offsets, searcher, *, manifest_sha256: str | None = None,
                 read_keys=None) -> None:
        self.path = path
        self.manifest = manifest
        self.manifest_sha256 = manifest_sha256
        self.mean = mean
        self.std = std
        self.components = components
        self._keys = keys
        self._read_keys = read_keys
        self.values = values
        self.doc_offsets = doc_offsets
        self.searcher = searcher
        self.index = manifest["index"]

    @property
    def keys(self) -> np.ndarray:
        """``[n, dims]`` reduced keys (the index input), read on first use."""
        if self._keys is None:
            self._keys = self._read_keys()
        return self._keys

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
             verify_checksums: bool = True,
             expect_manifest_sha256: str | None = None) -> DenseDatastore:
        """Open and verify a store. Every failure is a one-line
        :class:`DatastoreError`: missing store/file, corrupted file (size or
        checksum), unsupported format, a file name leaving the folder, a
        listed pickle, a hidden size / vocab size / tokenizer that differs
        from the target's, or (``expect_manifest_sha256``) a manifest other
        than the one checked before. Unlisted files are never opened."""
        path = os.path.abspath(os.path.expanduser(path))
        where = f"dense datastore {path}"
        if not os.path.isdir(path):
            raise DatastoreError(f"{where}: no such directory")
        manifest, digest = _read_manifest(path, where)
        check_pin(digest, expect_manifest_sha256, where)
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise DatastoreError(
                f"{where}: unsupported format {manifest.get('format')!r} "
                f"v{manifest.get('format_version')!r} (expected {FORMAT} v{FORMAT_VERSION})")
        files = _listed_files(path, manifest, where)
        _check_target(manifest, where, expect_hidden_size, expect_vocab_size,
                      expect_tokenizer_hash)

        def load(name: str) -> np.ndarray:
            real, info = files[name]
            buf = read_verified(real, where, name, nbytes=info["bytes"],
                                sha256=info["sha256"] if verify_checksums else None)
            return npy_from_buffer(buf, where, name)

        mean = load("zscore_mean.npy")
        std = load("zscore_std.npy")
        comps = load("pca_components.npy")
        values = load("values.npy")
        offsets = load("doc_offsets.npy")
        if verify_checksums:  # the files serving does not read: checked, not kept
            for name, (real, info) in files.items():
                if name not in _READ_AT_OPEN and not name.startswith(SCANN_DIR + "/"):
                    if hash_file(real, where, name) != info["sha256"]:
                        raise DatastoreError(f"{where}: corrupted file '{name}' (sha256 "
                                             "mismatch)")
        h, d, n, nn = (int(manifest["hidden_size"]), int(manifest["dims"]),
                       int(manifest["counts"]["keys"]), int(manifest["n_next"]))
        keys_info = files["keys.npy"][1]
        if not _npy_shape_fits(keys_info["bytes"], (n, d), np.float32):
            raise DatastoreError(f"{where}: corrupted file 'keys.npy' (size "
                                 f"{keys_info['bytes']} bytes for {n} x {d} keys)")
        for name, arr, shape in (("zscore_mean.npy", mean, (h,)), ("zscore_std.npy", std, (h,)),
                                 ("pca_components.npy", comps, (h, d)),
                                 ("values.npy", values, (n, nn))):
            if arr.shape != shape:
                raise DatastoreError(f"{where}: corrupted file '{name}' (shape {arr.shape}, "
                                     f"expected {shape})")
        searcher = _load_searcher(files, where, verify_checksums)

        def read_keys() -> np.ndarray:
            keys = load("keys.npy")
            if keys.shape != (n, d):
                raise DatastoreError(f"{where}: corrupted file 'keys.npy' (shape {keys.shape}, "
                                     f"expected {(n, d)})")
            return keys

        return cls(path, manifest, mean, std, comps, None, values, offsets, searcher,
                   manifest_sha256=digest, read_keys=read_keys)

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
            rows[order] = self.values[flat[order]]  # sorted reads: cache friendly
            seqs[ok] = rows
        return seqs, scores


# ---------------------------------------------------------------------------
# Opening: manifest, listed files, ScaNN from a private copy
# ---------------------------------------------------------------------------

# Read into memory at open, checksummed as read; the other files are hashed.
_READ_AT_OPEN = ("zscore_mean.npy", "zscore_std.npy", "pca_components.npy", "values.npy",
                 "doc_offsets.npy")
_REQUIRED = _READ_AT_OPEN + ("keys.npy",)
_SCANN_ASSETS = "scann_assets.pbtxt"


def _read_manifest(path: str, where: str) -> tuple[dict, str]:
    """The parsed manifest and the SHA-256 of its bytes."""
    mpath = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(mpath):
        raise DatastoreError(f"{where}: missing file '{MANIFEST_FILE}' (not a dense "
                             f"datastore or an unfinished build)")
    real = confined_path(path, MANIFEST_FILE, where)
    try:
        raw = bytes(read_verified(real, where, MANIFEST_FILE))
        manifest = json.loads(raw)
    except (OSError, ValueError) as e:
        if isinstance(e, DatastoreError):
            raise
        raise DatastoreError(f"{where}: corrupted file '{MANIFEST_FILE}' ({e})".replace(
            "\n", " ")) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise DatastoreError(f"{where}: corrupted file '{MANIFEST_FILE}' (not a manifest)")
    return manifest, sha256_hex(raw)


def _listed_files(path: str, manifest: dict, where: str) -> dict[str, tuple[str, dict]]:
    """name -> (real path inside the folder, manifest entry), sizes checked."""
    files = manifest.get("files", {})
    refuse_pickles(files, where)
    reals = {name: confined_path(path, name, where) for name in files}
    for name in _REQUIRED:
        if name not in files:
            raise DatastoreError(f"{where}: manifest lists no '{name}'")
    out: dict[str, tuple[str, dict]] = {}
    for name, info in sorted(files.items()):
        real = reals[name]
        if not os.path.isfile(real):
            raise DatastoreError(f"{where}: missing file '{name}'")
        size = os.path.getsize(real)
        if not isinstance(info, dict) or size != info.get("bytes"):
            want = info.get("bytes") if isinstance(info, dict) else None
            raise DatastoreError(f"{where}: corrupted file '{name}' (size {size} bytes, "
                                 f"manifest says {want})")
        out[name] = (real, info)
    return out


def _check_target(manifest: dict, where: str, hidden_size, vocab_size, tokenizer_hash) -> None:
    model = manifest.get("model", {}).get("id", "?")
    if hidden_size is not None and int(manifest["hidden_size"]) != hidden_size:
        raise DatastoreError(
            f"{where}: hidden size mismatch: built for {manifest['hidden_size']} "
            f"(model {model}), target has {hidden_size}")
    if vocab_size is not None and int(manifest["vocab_size"]) != vocab_size:
        raise DatastoreError(
            f"{where}: vocab size mismatch: built for {manifest['vocab_size']} "
            f"(model {model}), target has {vocab_size}")
    if tokenizer_hash is not None and manifest["tokenizer_hash"] != tokenizer_hash:
        raise DatastoreError(
            f"{where}: tokenizer mismatch: built with {manifest['tokenizer_hash'][:28]}... "
            f"(model {model}), target tokenizer is {tokenizer_hash[:28]}...")


def _npy_shape_fits(nbytes: int, shape: tuple[int, ...], dtype) -> bool:
    """A cheap size check of an array read later: data plus a sane header."""
    data = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return data < nbytes <= data + (1 << 16)


def _load_searcher(files: dict[str, tuple[str, dict]], where: str, verify: bool):
    """The ScaNN searcher, loaded from a private folder holding only the
    listed ``scann/`` files (checked as copied). ScaNN's own
    ``load_searcher`` is not used: it unpickles ``scann_docids.pkl`` when
    present, and the plugin builds without docids."""
    import shutil
    import tempfile

    prefix = SCANN_DIR + "/"
    listed = {n[len(prefix):]: v for n, v in files.items() if n.startswith(prefix)}
    if _SCANN_ASSETS not in listed:
        raise DatastoreError(f"{where}: manifest lists no '{prefix}{_SCANN_ASSETS}'")
    private = tempfile.mkdtemp(prefix="specplug-scann-")  # 0700
    try:
        for rel, (real, info) in listed.items():
            dest = os.path.join(private, *rel.split("/"))
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            copy_verified(real, dest, where, prefix + rel, nbytes=info["bytes"],
                          sha256=info["sha256"] if verify else None)
        assets = _scann_assets(private, set(listed), where)
        try:
            import scann
            from scann.scann_ops.py import scann_ops_pybind

            native = scann_ops_pybind.scann_pybind.ScannNumpy(private, assets)
            return scann.scann_ops_pybind.ScannSearcher(native, docids=None)
        except Exception as e:  # noqa: BLE001
            raise DatastoreError(f"{where}: cannot load the ScaNN index "
                                 f"({type(e).__name__}: {e})".replace("\n", " ")) from None
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _scann_assets(private: str, listed: set[str], where: str) -> str:
    """``scann_assets.pbtxt`` re-serialized after checking that every asset
    it names is a listed file of the copy (no absolute or outside path)."""
    from google.protobuf import text_format
    from scann.scann_ops import scann_assets_pb2

    with open(os.path.join(private, _SCANN_ASSETS), encoding="utf-8") as f:
        text = f.read()
    assets = scann_assets_pb2.ScannAssets()
    try:
        text_format.Parse(text, assets)
    except text_format.ParseError as e:
        raise DatastoreError(f"{where}: corrupted file '{SCANN_DIR}/{_SCANN_ASSETS}' "
                             f"({e})".replace("\n", " ")) from None
    for asset in assets.assets:
        if asset.asset_path not in listed:
            raise DatastoreError(f"{where}: ScaNN asset {asset.asset_path!r} is not a file "
                                 f"listed under '{SCANN_DIR}/'")
    return text_format.MessageToString(assets)
