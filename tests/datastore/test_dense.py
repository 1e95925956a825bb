"""Dense (DReSD) datastore: build, manifest, transform, round trip, retrieval
quality, startup checks, CLI and in-distribution mode, on the tiny model."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time

import numpy as np
import pytest

from vllm_specplug import corpus
from vllm_specplug.datastore import build, dense
from vllm_specplug.datastore.build import build_dense_datastore, plan_index
from vllm_specplug.datastore.dense import DatastoreError, DenseDatastore, tokenizer_fingerprint

WORDS = ("the river valley morning water cold clear evening copper children stones fish "
         "stories mill miller dog cat goats garden beans weather sunny wind rain model token "
         "draft target accepts tree branch leaf verify sample").split()
N_DOCS = 48
N_DUP = 10  # held-out copies of the first N_DUP documents
N_NEXT = 12


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def model_path() -> str:
    from vllm_specplug.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # 2 shared cores: oversubscribed torch threads are many times slower.
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def lm(model_path):
    return build._load_model(model_path, "float32")


@pytest.fixture(scope="module")
def built(tmp_path_factory, model_path):
    d = tmp_path_factory.mktemp("dense")
    corpus = d / "corpus.txt"
    docs = _docs(N_DOCS, seed=1)
    corpus.write_text("\n".join(docs) + "\n", encoding="utf-8")
    out = d / "store"
    t = time.time()
    manifest = build_dense_datastore(
        model_path, str(out), corpus=str(corpus), n_next=N_NEXT, dims=32,
        chunk_tokens=512, keep_raw_keys=True, progress=False)
    seconds = time.time() - t
    print(f"\n[dense store] {manifest['counts']['keys']} keys, {manifest['total_bytes']} bytes, "
          f"build {seconds:.2f}s, index {manifest['index']['kind']}")
    return {"out": str(out), "manifest": manifest, "docs": docs, "dir": d}


def _tokens(lm, text: str) -> list[int]:
    return lm[1](text, add_special_tokens=True)["input_ids"]


# ---------------------------------------------------------------------------


def test_manifest_contents(built, model_path, lm):
    m = built["manifest"]
    on_disk = json.load(open(os.path.join(built["out"], "manifest.json")))
    assert on_disk == m
    assert m["format"] == "specplug-dense-datastore" and m["format_version"] == 1
    assert m["model"]["path"] == os.path.abspath(model_path)
    assert m["hidden_size"] == m["model"]["hidden_size"] == 256
    assert m["vocab_size"] == m["model"]["vocab_size"] == 512
    assert m["tokenizer_hash"] == tokenizer_fingerprint(model_path)
    assert m["tokenizer_hash"].startswith("vocab-sha256:")
    assert m["dims"] == 32 and m["n_next"] == N_NEXT
    lens = [len(_tokens(lm, t)) for t in built["docs"]]
    assert m["counts"]["docs"] == N_DOCS
    assert m["counts"]["tokens"] == sum(lens)
    assert m["counts"]["keys"] == sum(lens) - N_DOCS  # last position has no next token
    assert m["counts"]["sample"] == m["counts"]["keys"]
    assert m["index"]["kind"] == "brute_force"  # < BRUTE_FORCE_MAX_KEYS
    assert m["build_options"]["chunk_tokens"] == 512 and m["build_options"]["dims"] == 32
    assert m["build_seconds"] > 0 and m["created_at"].endswith("Z")
    assert 0 < m["transform"]["pca_explained_variance_ratio"] <= 1
    names = set(m["files"])
    assert {"zscore_mean.npy", "zscore_std.npy", "pca_components.npy", "keys.npy",
            "values.npy", "doc_offsets.npy", "raw_keys.npy"} <= names
    assert any(n.startswith("scann/") for n in names)
    assert not any(n.endswith(".tmp") for n in names)
    for name, info in m["files"].items():
        p = os.path.join(built["out"], name)
        assert os.path.getsize(p) == info["bytes"]
        assert dense._sha256_file(p) == info["sha256"]
    # ScaNN assets are stored relative: the store can move.
    assets = open(os.path.join(built["out"], "scann", "scann_assets.pbtxt")).read()
    assert built["out"] not in assets


def test_values_are_next_tokens(built, lm):
    ds = DenseDatastore.open(built["out"])
    off = ds.doc_offsets
    for d in (0, 7, N_DOCS - 1):
        ids = _tokens(lm, built["docs"][d])
        rows = np.asarray(ds.values[off[d] : off[d + 1]])
        assert rows.shape == (len(ids) - 1, N_NEXT)
        for t in (0, len(ids) // 2, len(ids) - 2):
            want = ids[t + 1 : t + 1 + N_NEXT]
            assert rows[t, : len(want)].tolist() == want
            assert (rows[t, len(want) :] == -1).all()


def test_transform_matches_numpy_reference(built):
    ds = DenseDatastore.open(built["out"])
    raw = np.load(os.path.join(built["out"], "raw_keys.npy")).astype(np.float64)
    mean = raw.mean(axis=0)
    std = np.sqrt(raw.var(axis=0) + dense.ZSCORE_EPS)
    np.testing.assert_allclose(ds.mean, mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ds.std, std, rtol=1e-5, atol=1e-5)
    z = (raw - mean) / std
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    ref = vt[: ds.dims].T
    # Components are defined up to sign.
    ref = ref * np.sign(np.sum(ref * ds.components, axis=0))
    np.testing.assert_allclose(ds.components, ref, atol=2e-3)
    ev = np.load(os.path.join(built["out"], "pca_explained_variance.npy"))
    np.testing.assert_allclose(ev, (s**2 / len(z))[: ds.dims], rtol=1e-4)
    v = z @ ref
    ref_keys = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), dense.L2_EPS)
    np.testing.assert_allclose(ds.keys, ref_keys, atol=5e-3)
    np.testing.assert_allclose(np.linalg.norm(ds.keys, axis=1), 1.0, atol=1e-5)
    # The query path applies exactly the stored transform.
    np.testing.assert_allclose(ds.embed(raw[:50].astype(np.float32)), ds.keys[:50], atol=1e-5)


def test_fit_transform_subsamples():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5000, 24)).astype(np.float32) * np.arange(1, 25) + 3.0
    fit = build.fit_transform(x, 8, max_sample=1000, seed=3, chunk_rows=300)
    assert int(fit["sample_size"]) == 1000
    rows = np.sort(np.random.default_rng(3).choice(5000, size=1000, replace=False))
    np.testing.assert_allclose(fit["mean"], x[rows].astype(np.float64).mean(0), rtol=1e-5)
    with pytest.raises(DatastoreError, match="exceeds the hidden size"):
        build.fit_transform(x, 25, max_sample=100)


def test_round_trip_query(built):
    ds = DenseDatastore.open(built["out"])
    raw = np.load(os.path.join(built["out"], "raw_keys.npy"), mmap_mode="r")
    rows = np.arange(0, len(ds), 7)
    seqs, scores = ds.query(np.asarray(raw[rows]), 5)
    assert seqs.shape == (len(rows), 5, N_NEXT) and seqs.dtype == np.int32
    assert scores.shape == (len(rows), 5)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)
    # Top-1 is the row itself or an identical context (same key); the values
    # come from the top ids.
    ids, _ = ds.search(ds.embed(np.asarray(raw[rows])), 5)
    same = [i == r or np.allclose(ds.keys[i], ds.keys[r], atol=1e-5)
            for i, r in zip(ids[:, 0], rows)]
    assert all(same)
    np.testing.assert_array_equal(seqs, np.asarray(ds.values)[ids])
    # Fewer neighbours than asked: padded.
    seqs, scores = ds.query(np.asarray(raw[:2]), len(ds) + 3)
    assert (seqs[:, -3:] == -1).all() and np.isneginf(scores[:, -3:]).all()
    with pytest.raises(DatastoreError, match=r"expected hidden states \[B, 256\]"):
        ds.query(np.zeros((1, 255), np.float32), 3)


def _mrr(ds, searcher_fn, queries_raw, targets, k=10):
    """Mean reciprocal rank of ``targets`` (store rows); any row with an
    identical key (same context) counts as the target."""
    ids = searcher_fn(ds.embed(queries_raw), k)
    rr = []
    for row, t in zip(ids, targets):
        r = 0.0
        for rank, i in enumerate(row, 1):
            if i >= 0 and (i == t or np.allclose(ds.keys[i], ds.keys[t], atol=1e-5)):
                r = 1.0 / rank
                break
        rr.append(r)
    return float(np.mean(rr)), float(np.mean(np.asarray(rr) == 1.0))


def test_retrieval_mrr_on_held_out_duplicates(built, lm):
    """Held-out documents that duplicate store documents, run through the
    target separately (other batch shapes): every position's context exists
    in the store, so the exact index must return it at rank 1 (floor 0.99:
    the only slack is float noise between batch shapes, ~1e-6 in cosine,
    against a next-best neighbour that is a different context). The
    tree + AH + reorder index, forced on this small store with its default
    sizing, must keep MRR >= 0.9: the reorder step rescores exactly, so a
    miss means the true row fell outside the searched leaves or the AH
    pre-selection."""
    model, tok = lm
    ds = DenseDatastore.open(built["out"])
    queries, targets = [], []
    for d in range(N_DUP):
        ids = _tokens(lm, built["docs"][d])
        h = build._doc_hiddens(model, [ids], 4096)[0]
        queries.append(h[:-1])
        targets.extend(range(ds.doc_offsets[d], ds.doc_offsets[d] + len(ids) - 1))
    q = np.concatenate(queries)

    exact = lambda e, k: ds.search(e, k)[0]  # noqa: E731
    t = time.perf_counter()
    mrr, top1 = _mrr(ds, exact, q, targets)
    ms = 1e3 * (time.perf_counter() - t) / len(q)
    print(f"\n[MRR] exact ({ds.index['kind']}): MRR {mrr:.4f}, rank-1 {top1:.4f} "
          f"over {len(q)} held-out duplicate positions ({ms:.3f} ms/query incl. scoring)")
    assert mrr >= 0.99 and top1 >= 0.99

    plan = plan_index(len(ds), "tree_ah", reorder=64)
    searcher = build._build_searcher(np.ascontiguousarray(ds.keys), plan, 10)
    tree = lambda e, k: np.asarray(searcher.search_batched(e, final_num_neighbors=k)[0])  # noqa: E731
    mrr_t, top1_t = _mrr(ds, tree, q, targets)
    print(f"[MRR] tree_ah ({plan.num_leaves} leaves, search {plan.leaves_to_search}, "
          f"reorder {plan.reorder}): MRR {mrr_t:.4f}, rank-1 {top1_t:.4f}")
    assert mrr_t >= 0.9

    # Novel held-out text: next-token agreement of the top neighbour is only
    # reported (random weights: no semantic floor to justify).
    novel = _docs(5, seed=99)
    hits = total = 0
    for text in novel:
        ids = _tokens(lm, text)
        h = build._doc_hiddens(model, [ids], 4096)[0]
        seqs, _ = ds.query(h[:-1], 1)
        hits += int((seqs[:, 0, 0] == np.asarray(ids[1:])).sum())
        total += len(ids) - 1
    print(f"[novel] top-1 first-token agreement {hits / total:.3f} over {total} positions")


def test_self_retrieval_mrr(built):
    """The paper's intrinsic metric: stored keys retrieve themselves."""
    ds = DenseDatastore.open(built["out"])
    raw = np.load(os.path.join(built["out"], "raw_keys.npy"), mmap_mode="r")
    rows = np.arange(0, len(ds), 3)
    mrr, top1 = _mrr(ds, lambda e, k: ds.search(e, k)[0], np.asarray(raw[rows]), rows)
    print(f"\n[MRR] self-retrieval: {mrr:.4f} (rank-1 {top1:.4f}, {len(rows)} keys)")
    assert mrr >= 0.99


def test_long_documents_are_windowed_with_cache(lm):
    model, _ = lm
    ids = list(range(3, 3 + 90))
    whole = build._doc_hiddens(model, [ids], 4096)[0]
    windowed = build._doc_hiddens(model, [ids], 32)[0]
    np.testing.assert_allclose(windowed, whole, atol=1e-4)
    batched = build._doc_hiddens(model, [ids[:40], ids], 4096)
    np.testing.assert_allclose(batched[0], whole[:40], atol=1e-4)
    np.testing.assert_allclose(batched[1], whole, atol=1e-4)
    assert [len(b) for b in corpus.batches([[0] * 10] * 5 + [[0] * 50], 30)] == [3, 2, 1]


def test_last_hidden_is_lm_head_input(lm):
    model, _ = lm
    build.check_lm_head_input(model, list(range(5, 20)))  # raises if not


def test_plan_index_follows_scann_guidance():
    assert plan_index(19_999).kind == "brute_force"
    assert plan_index(20_000).kind == "ah"
    p = plan_index(1_000_000)
    assert p.kind == "tree_ah" and p.num_leaves == 1000 and p.leaves_to_search == 50
    assert p.dims_per_block == 2 and p.reorder == 256
    assert plan_index(200, "tree_ah").num_leaves == 14
    with pytest.raises(DatastoreError, match="unknown index kind"):
        plan_index(10, "hnsw")


# ---------------------------------------------------------------------------
# Startup checks: one-line errors


def _copy(built, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(built["out"], dst)
    return dst


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_open_checks(built, tmp_path, model_path):
    ok = DenseDatastore.open(built["out"], expect_hidden_size=256, expect_vocab_size=512,
                             expect_tokenizer_hash=tokenizer_fingerprint(model_path))
    assert len(ok) == built["manifest"]["counts"]["keys"]

    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(str(tmp_path / "nope"))
    assert "no such directory" in _one_line(e)

    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(built["out"], expect_hidden_size=4096)
    assert "hidden size mismatch: built for 256" in _one_line(e)
    assert "target has 4096" in str(e.value)

    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(built["out"], expect_vocab_size=32000)
    assert "vocab size mismatch" in _one_line(e)

    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(built["out"], expect_tokenizer_hash="vocab-sha256:" + "0" * 64)
    assert "tokenizer mismatch" in _one_line(e)

    p = _copy(built, tmp_path)
    os.remove(os.path.join(p, "values.npy"))
    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(p)
    assert "missing file 'values.npy'" in _one_line(e)
    shutil.rmtree(p)

    p = _copy(built, tmp_path)
    with open(os.path.join(p, "keys.npy"), "r+b") as f:
        f.seek(-7, os.SEEK_END)
        b = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x55]))
    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(p)
    assert "corrupted file 'keys.npy' (sha256 mismatch)" in _one_line(e)
    DenseDatastore.open(p, verify_checksums=False)  # sizes still agree
    shutil.rmtree(p)

    p = _copy(built, tmp_path)
    with open(os.path.join(p, "scann", "dataset.npy"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(p, verify_checksums=False)
    assert "corrupted file 'scann/dataset.npy' (size 100 bytes" in _one_line(e)
    shutil.rmtree(p)

    p = _copy(built, tmp_path)
    os.remove(os.path.join(p, "manifest.json"))
    with pytest.raises(DatastoreError) as e:
        DenseDatastore.open(p)
    assert "missing file 'manifest.json'" in _one_line(e)


# ---------------------------------------------------------------------------
# CLI, jsonl corpus, in-distribution mode


def _cli(argv) -> int:
    from vllm_specplug.cli import datastore as cli

    parser = argparse.ArgumentParser(prog="specplug")
    cli.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_jsonl_and_in_distribution(tmp_path, model_path, lm, capsys):
    corpus = tmp_path / "c.jsonl"
    recs = [{"text": t} for t in _docs(4, seed=5)]
    recs.append({"prompt": "tell me about the river", "response": "the river is cold"})
    recs.append({"turns": ["a dog", "and a cat"]})
    recs.append({"response": "only a response here"})
    corpus.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t, "second turn"]})
                                 for t in _docs(3, seed=6)) + "\n")
    out = tmp_path / "store"
    rc = _cli(["datastore", "build-dense", "--model", model_path, "--corpus", str(corpus),
               "--out", str(out), "--n-next", "6", "--dims", "16", "--in-distribution",
               str(prompts), "--max-new-tokens", "8", "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["docs"] == len(recs) + 3
    assert summary["counts"]["in_distribution_responses"] == 3
    m = json.load(open(out / "manifest.json"))
    assert m["build_options"]["in_distribution"] == str(prompts)
    assert "responses.jsonl" in m["files"]
    resp = [json.loads(x) for x in open(out / "responses.jsonl")]
    assert len(resp) == 3
    assert resp[0]["prompt"].startswith("<|im_start|>user\n")  # chat template
    assert 1 <= len(resp[0]["response_ids"]) <= 8
    # Generated documents come first: prompt tokens + greedy response tokens.
    ds = DenseDatastore.open(str(out))
    tok = lm[1]
    first = tok(resp[0]["prompt"], add_special_tokens=False)["input_ids"] + resp[0]["response_ids"]
    got = np.asarray(ds.values[ds.doc_offsets[0] : ds.doc_offsets[1], 0])
    assert got.tolist() == first[1:]
    # The greedy response is the model's own argmax continuation.
    import torch

    with torch.no_grad():
        logits = lm[0](torch.tensor([first])).logits[0]
    n_prompt = len(first) - len(resp[0]["response_ids"])
    assert logits[n_prompt - 1 : -1].argmax(-1).tolist() == resp[0]["response_ids"]

    assert _cli(["datastore", "info", str(out)]) == 0
    assert _cli(["datastore", "build-dense", "--model", model_path, "--corpus", str(corpus),
                 "--out", str(out), "--no-progress"]) == 1  # exists, no --overwrite
    assert "exists and is not empty" in capsys.readouterr().err
