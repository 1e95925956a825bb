"""`specplug datastore build-sa` and every fault found when a store opens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from vllm_specplug.datastore.dense import DatastoreError
from vllm_specplug.datastore.suffix_array import build_sa_datastore, open_sa_datastore

TEXTS = ["def add(a, b):\n    return a + b", "the cat sat on the mat",
         "the cat sat on the hat", "def sub(a, b):\n    return a - b"]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("sa")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = root / "store"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_specplug.cli", "datastore", "build-sa", "--model",
         tiny_model, "--corpus", str(corpus), "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["num_documents"] == len(TEXTS)
    return str(out)


def test_store_counts_what_the_corpus_holds(store_dir, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    store = open_sa_datastore(store_dir, vocab_size=len(tok), tokenizer=tiny_model)
    # In memory, read-only: a file changed on disk later cannot reach the server.
    for arr in (store.tokens, store.sa):
        assert not isinstance(arr, np.memmap) and not arr.flags.writeable
    key = tok("the cat sat on the", add_special_tokens=False)["input_ids"]
    ids, counts = store.next_token_counts(key)
    want = {}
    for t in TEXTS:
        ids_t = tok(t, add_special_tokens=False)["input_ids"]
        for i in range(len(ids_t) - len(key)):
            if ids_t[i : i + len(key)] == key:
                want[ids_t[i + len(key)]] = want.get(ids_t[i + len(key)], 0) + 1
    assert want and dict(zip(ids.tolist(), counts.tolist())) == want


def _copy(store_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(store_dir, dst)
    return str(dst)


def _truncate(d):
    p = os.path.join(d, "sa.npy")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 8)


def _corrupt(d):
    p = os.path.join(d, "tokens.npy")
    with open(p, "r+b") as f:
        f.seek(-2, 2)
        b = f.read(2)
        f.seek(-2, 2)
        f.write(bytes(x ^ 0xFF for x in b))


def _edit_manifest(**kw):
    def edit(d):
        p = os.path.join(d, "manifest.json")
        m = json.load(open(p))
        m.update(kw)
        json.dump(m, open(p, "w"))
    return edit


FAULTS = [
    ("missing folder", lambda d: shutil.rmtree(d), "no such folder"),
    ("missing manifest", lambda d: os.remove(os.path.join(d, "manifest.json")),
     "manifest.json missing"),
    ("bad manifest", lambda d: open(os.path.join(d, "manifest.json"), "w").write("{"),
     "not valid JSON"),
    ("missing tokens", lambda d: os.remove(os.path.join(d, "tokens.npy")), "tokens.npy: missing"),
    ("truncated", _truncate, "truncated or replaced"),
    ("corrupt", _corrupt, "checksum mismatch"),
    ("old format", _edit_manifest(format_version=0), "rebuild it"),
    ("other tokenizer", _edit_manifest(tokenizer_fingerprint="vocab-sha256:00"),
     "another tokenizer"),
    ("bigger vocabulary", _edit_manifest(vocab_size=10**6), "vocabulary of 1000000"),
]


@pytest.mark.parametrize("name,fault,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_every_fault_is_one_line_at_open(store_dir, tmp_path, tiny_model, name, fault,
                                         message):
    d = _copy(store_dir, tmp_path)
    fault(d)
    with pytest.raises(DatastoreError) as err:
        open_sa_datastore(d, vocab_size=512, tokenizer=tiny_model)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_build_refuses_empty_corpus_and_nonempty_out(tmp_path, tiny_model):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DatastoreError, match="no documents"):
        build_sa_datastore(tiny_model, str(tmp_path / "o"), [str(empty)], progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(DatastoreError, match="not empty"):
        build_sa_datastore(tiny_model, str(tmp_path / "full"), [str(empty)], progress=False)
