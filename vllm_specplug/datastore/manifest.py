"""Reading a datastore folder through its manifest, and nothing else.

A store is served from the files its ``manifest.json`` lists, read once into
process memory while their SHA-256 is computed, so:

* a file the manifest does not list is never opened (a ``scann_docids.pkl``
  dropped into the folder is ignored, never unpickled); a manifest that lists
  a pickle is refused;
* a listed name is a relative path inside the store folder: an absolute
  path, a ``..`` or ``.`` component, or a symbolic link resolving outside
  the folder is refused;
* the checksum covers the bytes actually served (nothing is re-read after
  the check), and a file truncated or rewritten on disk later cannot reach a
  running server (no memory map, so no SIGBUS);
* ``manifest_sha256`` identifies the manifest: the front end checks the store
  and hands that digest to the engine, which refuses a store whose manifest
  has changed in between.

Every failure is a one-line :class:`DatastoreError`.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat

import numpy as np

MANIFEST_FILE = "manifest.json"
#: Options key the front end fills with the checked manifest's SHA-256.
PIN_OPTION = "datastore_sha256"
PICKLE_SUFFIXES = (".pkl", ".pickle")

_CHUNK = 1 << 22
# .npy headers are a few hundred bytes; format 2.0 allows up to 4 GiB, which
# numpy itself refuses above 10,000 bytes by default.
_MAX_NPY_HEADER = 1 << 16


class DatastoreError(ValueError):
    """A datastore problem; the message is one line."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def confined_path(root: str, name: object, where: str) -> str:
    """The real path of a manifest-listed ``name`` inside ``root``; refuses
    names that leave the folder (absolute, ``..``, links pointing out)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise DatastoreError(f"{where}: manifest lists an invalid file name {name!r}")
    parts = name.split("/")
    if name.startswith("/") or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
        raise DatastoreError(f"{where}: manifest file name {name!r} is not a plain relative "
                             "path inside the store folder")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, *parts))
    if os.path.commonpath([real, real_root]) != real_root or real == real_root:
        raise DatastoreError(f"{where}: manifest file {name!r} resolves outside the store "
                             "folder (symbolic link)")
    return real


def refuse_pickles(files: dict, where: str) -> None:
    """The plugin never writes a pickle, so a store listing one was not
    built by it (ScaNN would unpickle ``scann_docids.pkl`` on load)."""
    for name in files:
        if str(name).lower().endswith(PICKLE_SUFFIXES):
            raise DatastoreError(f"{where}: manifest lists a pickle {name!r}; pickles are "
                                 "never loaded (rebuild the store)")


def check_pin(digest: str, expected: str | None, where: str) -> None:
    """Refuse a manifest other than the one checked at start-up."""
    if expected is not None and digest != expected:
        raise DatastoreError(
            f"{where}: {MANIFEST_FILE} changed since it was checked (sha256 {digest[:16]}..., "
            f"expected {expected[:16]}...); restart the server on a stable store")


def _open_regular(path: str, where: str, name: str) -> int:
    """An fd on a regular file: no FIFO to block on, no device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DatastoreError(f"{where}: '{name}' is not a regular file")
    return fd


def read_verified(path: str, where: str, name: str, *, nbytes: int | None = None,
                  sha256: str | None = None) -> bytearray:
    """The whole file in memory; its length must be ``nbytes`` and, when
    ``sha256`` is given, its digest that value (checked on these bytes)."""
    fd = _open_regular(path, where, name)
    try:
        size = os.fstat(fd).st_size if nbytes is None else nbytes
        buf = bytearray(size)
        view = memoryview(buf)
        h = hashlib.sha256()
        got = 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while got < size:
                n = f.readinto(view[got : got + _CHUNK])
                if not n:
                    break
                h.update(view[got : got + n])
                got += n
            extra = f.read(1)
    finally:
        os.close(fd)
    if got != size or extra:
        raise DatastoreError(f"{where}: corrupted file '{name}' (size changed while reading; "
                             f"the manifest says {size} bytes)")
    if sha256 is not None and h.hexdigest() != sha256:
        raise DatastoreError(f"{where}: corrupted file '{name}' (sha256 mismatch)")
    return buf


def copy_verified(path: str, dest: str, where: str, name: str, *, nbytes: int,
                  sha256: str | None) -> None:
    """Copy a listed file to ``dest`` (created, 0600), checking its size and
    digest on the bytes written."""
    fd = _open_regular(path, where, name)
    h = hashlib.sha256()
    got = 0
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                      0o600)
        with os.fdopen(fd, "rb", closefd=False) as src, os.fdopen(out, "wb") as dst:
            while True:
                block = src.read(_CHUNK)
                if not block:
                    break
                h.update(block)
                dst.write(block)
                got += len(block)
    finally:
        os.close(fd)
    if got != nbytes:
        raise DatastoreError(f"{where}: corrupted file '{name}' (size changed while reading; "
                             f"the manifest says {nbytes} bytes)")
    if sha256 is not None and h.hexdigest() != sha256:
        raise DatastoreError(f"{where}: corrupted file '{name}' (sha256 mismatch)")


def hash_file(path: str, where: str, name: str) -> str:
    """SHA-256 of a listed file read in chunks (nothing kept)."""
    fd = _open_regular(path, where, name)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def npy_from_buffer(buf: bytearray, where: str, name: str) -> np.ndarray:
    """A read-only array over the bytes of an ``.npy`` file, without a
    second copy; object arrays (pickles) are refused."""
    fmt = np.lib.format
    try:
        head = io.BytesIO(bytes(buf[:_MAX_NPY_HEADER]))
        version = fmt.read_magic(head)
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read_header(head)
        offset = head.tell()
    except Exception as e:  # noqa: BLE001 - any malformed header is one error
        raise DatastoreError(f"{where}: corrupted file '{name}' ({type(e).__name__})") from None
    if dtype.hasobject:
        raise DatastoreError(f"{where}: '{name}' holds Python objects (a pickle); refused")
    count = int(np.prod(shape, dtype=np.int64))
    if len(buf) - offset != count * dtype.itemsize:
        raise DatastoreError(f"{where}: corrupted file '{name}' (data size disagrees with its "
                             "header)")
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    arr = arr.reshape(shape, order="F" if fortran else "C")
    arr.flags.writeable = False
    return arr


def pin_manifest(vllm_config, digest: str) -> None:
    """Record the checked manifest's digest in the method options the engine
    processes receive, so the worker opens that store or none."""
    from vllm_specplug.config import ADDITIONAL_CONFIG_KEY

    extra = getattr(vllm_config, "additional_config", None)
    spec = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    if isinstance(spec, dict) and isinstance(spec.get("options"), dict):
        spec["options"][PIN_OPTION] = digest
