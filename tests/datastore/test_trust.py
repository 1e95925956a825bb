"""Datastores are served from the files their manifest lists and nothing else:
names confined to the folder, no pickle ever loaded, the engine refusing a
manifest other than the one the front end checked, and files changed on disk
after start-up unable to reach (or kill) a running server."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_specplug.config import ADDITIONAL_CONFIG_KEY, SpecplugConfigError
from vllm_specplug.datastore.build import build_dense_datastore
from vllm_specplug.datastore.dense import DatastoreError, DenseDatastore
from vllm_specplug.datastore.suffix_array import build_sa_datastore, open_sa_datastore

TEXTS = ["the cat sat on the mat and the dog sat on the log",
         "the river runs cold and clear in the morning",
         "def add(a, b):\n    return a + b",
         "the cat sat on the hat and the dog ran to the river"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust_corpus")
    p = d / "corpus.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    return str(p)


@pytest.fixture(scope="module")
def sa_store(tmp_path_factory, tiny_model, corpus):
    out = tmp_path_factory.mktemp("trust_sa") / "store"
    build_sa_datastore(tiny_model, str(out), [corpus], progress=False)
    return str(out)


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory, tiny_model, corpus):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("trust_dense") / "store"
        build_dense_datastore(tiny_model, str(out), corpus=corpus, n_next=6, dims=8,
                              chunk_tokens=512, progress=False)
    finally:
        torch.set_num_threads(old)
    return str(out)


def _copy(store: str, tmp_path, name="copy") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(store, dst)
    return dst


def _manifest(d: str) -> dict:
    with open(os.path.join(d, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _write_manifest(d: str, m: dict) -> None:
    with open(os.path.join(d, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(m, f)


def _entry(path: str) -> dict:
    data = open(path, "rb").read()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _list_file(d: str, name: str, real_path: str | None = None) -> None:
    """Add ``name`` to the manifest with the size and digest of the file
    (or of ``real_path``), so only the name can be wrong."""
    m = _manifest(d)
    m["files"][name] = _entry(real_path or os.path.join(d, name))
    _write_manifest(d, m)


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


class _Marker:
    """Unpickling this creates the file ``path`` (as a hostile pickle would
    run any code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant_pickle(path: str, marker: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(_Marker(marker), f)


# ---------------------------------------------------------------------------
# Names confined to the store folder


@pytest.mark.parametrize("bad", ["../x.npy", "/etc/hostname", "a/../../x.npy", "./tokens.npy"])
def test_sa_manifest_names_outside_the_folder_are_refused(sa_store, tmp_path, bad):
    d = _copy(sa_store, tmp_path)
    (tmp_path / "x.npy").write_bytes(b"outside")
    m = _manifest(d)
    m["files"][bad] = {"bytes": 7, "sha256": "0" * 64}
    _write_manifest(d, m)
    with pytest.raises(DatastoreError) as err:
        open_sa_datastore(d)
    assert "not a plain relative path inside the store folder" in _one_line(err)


def test_dense_manifest_dotdot_is_refused(dense_store, tmp_path):
    d = _copy(dense_store, tmp_path)
    shutil.copy(os.path.join(d, "values.npy"), tmp_path / "values.npy")
    m = _manifest(d)
    m["files"]["../values.npy"] = m["files"].pop("values.npy")
    _write_manifest(d, m)
    with pytest.raises(DatastoreError) as err:
        DenseDatastore.open(d)
    assert "'../values.npy' is not a plain relative path" in _one_line(err)


def test_symlink_out_of_the_folder_is_refused(sa_store, dense_store, tmp_path):
    # Same bytes outside: size and checksum agree, only the location is wrong.
    d = _copy(sa_store, tmp_path, "sa")
    outside = tmp_path / "tokens_outside.npy"
    shutil.move(os.path.join(d, "tokens.npy"), outside)
    os.symlink(outside, os.path.join(d, "tokens.npy"))
    with pytest.raises(DatastoreError) as err:
        open_sa_datastore(d)
    assert "'tokens.npy' resolves outside the store folder" in _one_line(err)

    d = _copy(dense_store, tmp_path, "dense")
    outside = tmp_path / "scann_outside"
    shutil.move(os.path.join(d, "scann"), outside)
    os.symlink(outside, os.path.join(d, "scann"))
    with pytest.raises(DatastoreError) as err:
        DenseDatastore.open(d)
    assert "resolves outside the store folder" in _one_line(err)


def test_symlink_inside_the_folder_is_followed(sa_store, tmp_path):
    d = _copy(sa_store, tmp_path)
    os.rename(os.path.join(d, "sa.npy"), os.path.join(d, "sa.real.npy"))
    os.symlink("sa.real.npy", os.path.join(d, "sa.npy"))
    store = open_sa_datastore(d)
    ref = open_sa_datastore(sa_store)
    assert np.array_equal(store.sa, ref.sa)


def test_scann_asset_path_outside_is_refused(dense_store, tmp_path):
    d = _copy(dense_store, tmp_path)
    pbtxt = os.path.join(d, "scann", "scann_assets.pbtxt")
    text = open(pbtxt).read()
    assert 'asset_path: "dataset.npy"' in text
    open(pbtxt, "w").write(text.replace('"dataset.npy"', f'"{d}/keys.npy"'))
    _list_file(d, "scann/scann_assets.pbtxt")
    with pytest.raises(DatastoreError) as err:
        DenseDatastore.open(d)
    assert f"ScaNN asset '{d}/keys.npy' is not a file listed under 'scann/'" in _one_line(err)


# ---------------------------------------------------------------------------
# No pickle is ever loaded


def test_planted_docids_pickle_is_never_unpickled(dense_store, tmp_path):
    import scann

    d = _copy(dense_store, tmp_path)
    planted = os.path.join(d, "scann", "scann_docids.pkl")
    control = tmp_path / "control_marker"
    _plant_pickle(planted, str(control))
    # The hazard is real: ScaNN's own loader runs the pickle (then fails on
    # what it returned, too late).
    with pytest.raises(Exception):
        scann.scann_ops_pybind.load_searcher(os.path.join(d, "scann"),
                                             assets_backcompat_shim=False)
    assert control.exists()

    marker = tmp_path / "marker"
    _plant_pickle(planted, str(marker))
    ds = DenseDatastore.open(d)
    ref = DenseDatastore.open(dense_store)
    assert not marker.exists()
    q = np.random.default_rng(0).standard_normal((3, ds.hidden_size)).astype(np.float32)
    assert np.array_equal(ds.query(q, 4)[0], ref.query(q, 4)[0])  # serves the listed index


def test_listed_pickle_is_refused(dense_store, sa_store, tmp_path):
    marker = tmp_path / "marker"
    d = _copy(dense_store, tmp_path, "dense")
    _plant_pickle(os.path.join(d, "scann", "scann_docids.pkl"), str(marker))
    _list_file(d, "scann/scann_docids.pkl")
    with pytest.raises(DatastoreError) as err:
        DenseDatastore.open(d)
    assert "manifest lists a pickle 'scann/scann_docids.pkl'" in _one_line(err)

    d = _copy(sa_store, tmp_path, "sa")
    _plant_pickle(os.path.join(d, "extra.pickle"), str(marker))
    _list_file(d, "extra.pickle")
    with pytest.raises(DatastoreError) as err:
        open_sa_datastore(d)
    assert "manifest lists a pickle 'extra.pickle'" in _one_line(err)
    assert not marker.exists()


def test_object_array_is_refused(sa_store, tmp_path):
    d = _copy(sa_store, tmp_path)
    marker = tmp_path / "marker"
    tokens = os.path.join(d, "tokens.npy")
    np.save(tokens, np.array([_Marker(str(marker))], dtype=object), allow_pickle=True)
    _list_file(d, "tokens.npy")
    with pytest.raises(DatastoreError) as err:
        open_sa_datastore(d)
    assert "'tokens.npy' holds Python objects (a pickle); refused" in _one_line(err)
    assert not marker.exists()


# ---------------------------------------------------------------------------
# The engine opens the manifest the front end checked


def _vllm_config(method: str, options: dict, tiny_model: str):
    mc = SimpleNamespace(get_vocab_size=lambda: 512, get_hidden_size=lambda: 256,
                         tokenizer=tiny_model)
    spec = {"method": method, "options": dict(options)}
    return SimpleNamespace(model_config=mc, additional_config={ADDITIONAL_CONFIG_KEY: spec})


def _sha256(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _sa_config(method: str):
    from vllm_specplug.methods.auto import AutoConfig
    from vllm_specplug.methods.reader import ReaderConfig

    return {"reader": ReaderConfig, "auto": AutoConfig}[method]


@pytest.mark.parametrize("method", ["reader", "auto"])  # one set of datastore options
def test_sa_worker_refuses_a_manifest_changed_after_the_check(sa_store, tmp_path,
                                                              tiny_model, method):
    cls = _sa_config(method)
    d = _copy(sa_store, tmp_path)
    config = _vllm_config(method, {"datastore": d}, tiny_model)
    cls(datastore=d).check_engine(config)  # the front end's check
    options = config.additional_config[ADDITIONAL_CONFIG_KEY]["options"]
    pinned = options["datastore_sha256"]
    assert pinned == _sha256(os.path.join(d, "manifest.json"))

    worker = cls(**options)  # what the engine process builds
    store = worker.open_datastore(512, tiny_model)
    assert store.manifest_sha256 == pinned

    m = _manifest(d)
    m["num_documents"] += 1  # any change, even one the other checks accept
    _write_manifest(d, m)
    with pytest.raises(SpecplugConfigError) as err:
        worker.open_datastore(512, tiny_model)
    text = _one_line(err)
    now = _sha256(os.path.join(d, "manifest.json"))
    assert text.startswith("speculative_config['datastore']")
    assert f"manifest.json changed since it was checked (sha256 {now[:16]}" in text


def test_dresd_worker_refuses_a_manifest_changed_after_the_check(dense_store, tmp_path,
                                                                 tiny_model):
    import torch

    from vllm_specplug.engine.interface import ProposerContext
    from vllm_specplug.methods.dresd import DReSDConfig, DReSDProposer

    d = _copy(dense_store, tmp_path)
    config = _vllm_config("dresd", {"datastore": d}, tiny_model)
    DReSDConfig(datastore=d).check_engine(config)
    options = config.additional_config[ADDITIONAL_CONFIG_KEY]["options"]
    assert options["datastore_sha256"] == _sha256(os.path.join(d, "manifest.json"))

    ctx = ProposerContext(vocab_size=512, hidden_size=256, num_speculative_tokens=16,
                          max_model_len=512, device=torch.device("cpu"),
                          dtype=torch.float32, model_path=tiny_model,
                          tokenizer_path=tiny_model)
    DReSDProposer(DReSDConfig(**options), ctx)  # unchanged: opens

    m = _manifest(d)
    m["created_at"] = "2000-01-01T00:00:00Z"
    _write_manifest(d, m)
    with pytest.raises(DatastoreError) as err:
        DReSDProposer(DReSDConfig(**options), ctx)
    assert "manifest.json changed since it was checked" in _one_line(err)


def test_engine_config_carries_the_checked_manifest_digest(dense_store, tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.plugin import register

    register()
    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                        speculative_config={"method": "dresd", "num_speculative_tokens": 8,
                                            "datastore": dense_store}).create_engine_config()
    options = config.additional_config[ADDITIONAL_CONFIG_KEY]["options"]
    assert options["datastore_sha256"] == _sha256(os.path.join(dense_store, "manifest.json"))


def test_front_end_refuses_a_pin_that_does_not_match(sa_store, tiny_model):
    from vllm_specplug.methods.reader import ReaderConfig

    config = _vllm_config("reader", {}, tiny_model)
    with pytest.raises(SpecplugConfigError) as err:
        ReaderConfig(datastore=sa_store, datastore_sha256="f" * 64).check_engine(config)
    assert "changed since it was checked" in _one_line(err)


# ---------------------------------------------------------------------------
# Files truncated in place after start-up


_TRUNCATE_SA = """
import json, os, sys
import numpy as np
from vllm_specplug.datastore.suffix_array import open_sa_datastore
store_dir, key, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if mode == "mmap":  # what serving did before: arrays mapped from the files
    from vllm_specplug.sources.suffix_array import TokenSuffixArray
    m = json.load(open(os.path.join(store_dir, "manifest.json")))
    store = TokenSuffixArray(np.load(os.path.join(store_dir, "tokens.npy"), mmap_mode="r"),
                             np.load(os.path.join(store_dir, "sa.npy"), mmap_mode="r"),
                             m["separator"])
else:
    store = open_sa_datastore(store_dir)
for name in ("tokens.npy", "sa.npy"):
    os.truncate(os.path.join(store_dir, name), 0)
ids, counts = store.next_token_counts(key)
print(json.dumps(dict(zip(ids.tolist(), counts.tolist()))))
"""


def _counts_after_truncation(store_dir: str, key: list[int], mode: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_TRUNCATE_SA), store_dir,
                           json.dumps(key), mode], capture_output=True, text=True, timeout=120)


def test_truncating_sa_files_in_place_does_not_kill_the_server(sa_store, tmp_path,
                                                                tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    key = tok("the cat sat on the", add_special_tokens=False)["input_ids"]
    want: dict[int, int] = {}
    for text in TEXTS * 3:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for i in range(len(ids) - len(key)):
            if ids[i : i + len(key)] == key:
                want[ids[i + len(key)]] = want.get(ids[i + len(key)], 0) + 1
    assert len(want) == 2  # "mat" and "hat"

    # Memory-mapped arrays die with SIGBUS when their file shrinks under them.
    mapped = _counts_after_truncation(_copy(sa_store, tmp_path, "mapped"), key, "mmap")
    assert mapped.returncode == -7, (mapped.returncode, mapped.stderr[-500:])

    served = _counts_after_truncation(_copy(sa_store, tmp_path, "served"), key, "open")
    assert served.returncode == 0, served.stderr[-2000:]
    got = {int(k): v for k, v in json.loads(served.stdout).items()}
    assert got == want


def test_truncating_dense_files_in_place_keeps_serving(dense_store, tmp_path):
    d = _copy(dense_store, tmp_path)
    ds = DenseDatastore.open(d)
    q = np.random.default_rng(1).standard_normal((4, ds.hidden_size)).astype(np.float32)
    before = ds.query(q, 5)
    for root, _, names in os.walk(d):
        for name in names:
            os.truncate(os.path.join(root, name), 0)
    after = ds.query(q, 5)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert (before[0] >= 0).any()
    with pytest.raises(DatastoreError):  # a restart sees the damage, in one line
        DenseDatastore.open(d)


def test_unlisted_files_are_ignored(sa_store, tmp_path):
    d = _copy(sa_store, tmp_path)
    (tmp_path / "copy" / "notes.txt").write_text("not part of the store")
    os.symlink("/etc/hostname", os.path.join(d, "stray_link"))
    store = open_sa_datastore(d)
    assert np.array_equal(store.tokens, open_sa_datastore(sa_store).tokens)
