"""AdjacencyTable: update semantics, files, corpus warm start (CPU torch path)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from vllm_specplug.sources.adjacency import (
    UNTOUCHED,
    AdjacencyTable,
    build_from_corpus,
)


def _random_rows(n: int, vocab: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab // 4, (n,), generator=g)  # many duplicates
    topk = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    return tokens, topk


def _dict_reference(vocab: int, k: int, tokens, topk) -> torch.Tensor:
    want = torch.full((vocab, k), UNTOUCHED, dtype=torch.int32)
    for t, row in zip(tokens.tolist(), topk.tolist()):
        if 0 <= t < vocab:
            want[t] = torch.tensor(row[:k], dtype=torch.int32)
    return want


def test_fresh_table_is_untouched():
    t = AdjacencyTable(100, 8)
    assert t.table.shape == (100, 8) and t.table.dtype == torch.int32
    assert bool((t.table == UNTOUCHED).all())
    assert t.num_filled() == 0
    assert t.nbytes == 100 * 8 * 4


def test_update_last_duplicate_wins():
    t = AdjacencyTable(10, 3)
    tokens = torch.tensor([4, 2, 4, 7, 4])
    topk = torch.tensor([[1, 2, 3], [5, 6, 7], [8, 9, 0], [1, 1, 1], [3, 2, 1]])
    t.update(tokens, topk)
    assert t.table[4].tolist() == [3, 2, 1]
    assert t.table[2].tolist() == [5, 6, 7]
    assert t.table[7].tolist() == [1, 1, 1]
    assert t.num_filled() == 3


def test_update_matches_dict_reference_random():
    vocab, k = 200, 8
    t = AdjacencyTable(vocab, k)
    want = torch.full((vocab, k), UNTOUCHED, dtype=torch.int32)
    for seed in range(3):  # successive updates overwrite rows
        tokens, topk = _random_rows(300, vocab, k, seed)
        t.update(tokens, topk)
        for tok, row in zip(tokens.tolist(), topk.tolist()):
            want[tok] = torch.tensor(row, dtype=torch.int32)
    assert torch.equal(t.table, want)


def test_update_skips_out_of_vocab_and_empty():
    t = AdjacencyTable(10, 2)
    t.update(torch.tensor([-1, 10, 3]), torch.tensor([[1, 2], [3, 4], [5, 6]]))
    assert t.num_filled() == 1 and t.table[3].tolist() == [5, 6]
    t.update(torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long))
    assert t.num_filled() == 1
    with pytest.raises(ValueError):
        t.update(torch.tensor([1, 2]), torch.tensor([[1, 2]]))


def test_update_cuts_or_pads_width():
    t = AdjacencyTable(10, 3)
    t.update(torch.tensor([1]), torch.tensor([[9, 8, 7, 6, 5]]))
    t.update(torch.tensor([2]), torch.tensor([[4]]))
    assert t.table[1].tolist() == [9, 8, 7]
    assert t.table[2].tolist() == [4, UNTOUCHED, UNTOUCHED]


def test_lookup_unknown_tokens():
    t = AdjacencyTable(10, 2)
    t.update(torch.tensor([3]), torch.tensor([[1, 2]]))
    assert t.lookup(torch.tensor([3, -1, 99, 4])).tolist() == [[1, 2], [-1, -1], [-1, -1], [-1, -1]]


def test_clone_is_independent():
    t = AdjacencyTable(10, 2)
    c = t.clone()
    c.update(torch.tensor([1]), torch.tensor([[2, 3]]))
    assert t.num_filled() == 0 and c.num_filled() == 1


def test_save_load_round_trip(tmp_path):
    vocab, k = 300, 8
    t = AdjacencyTable(vocab, k, model_id="m1")
    t.update(*_random_rows(100, vocab, k))
    path = str(tmp_path / "sub" / "table.safetensors")
    t.save(path, corpus="c.jsonl")
    header = AdjacencyTable.read_header(path)
    assert header["vocab_size"] == "300" and header["k"] == "8"
    assert header["model_id"] == "m1" and header["corpus"] == "c.jsonl"
    back = AdjacencyTable.load(path, vocab)
    assert torch.equal(back.table, t.table) and back.model_id == "m1"
    # A narrower config keeps the best ranks; a wider one pads with -1.
    assert torch.equal(AdjacencyTable.load(path, vocab, k=4).table, t.table[:, :4])
    wide = AdjacencyTable.load(path, vocab, k=10).table
    assert torch.equal(wide[:, :8], t.table) and bool((wide[:, 8:] == UNTOUCHED).all())
    # The file is plain safetensors: no pickle anywhere.
    with open(path, "rb") as f:
        assert b"pickle" not in f.read(4096)


def test_load_vocab_mismatch_is_one_line_error(tmp_path):
    path = str(tmp_path / "t.safetensors")
    AdjacencyTable(300, 4, model_id="m1").save(path)
    with pytest.raises(ValueError) as e:
        AdjacencyTable.load(path, 512)
    msg = str(e.value)
    assert "\n" not in msg and "300" in msg and "512" in msg and "m1" in msg


def test_load_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        AdjacencyTable.load(str(tmp_path / "missing"), 10)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a table")
    with pytest.raises(ValueError, match="not a safetensors file"):
        AdjacencyTable.load(str(junk), 10)
    from safetensors.torch import save_file

    other = str(tmp_path / "other.safetensors")
    save_file({"table": torch.zeros(10, 2, dtype=torch.int32)}, other)
    with pytest.raises(ValueError, match="not a specplug adjacency table"):
        AdjacencyTable.load(other, 10)


def test_load_other_model_only_warns(tmp_path, caplog):
    path = str(tmp_path / "t.safetensors")
    AdjacencyTable(10, 2, model_id="a").save(path)
    with caplog.at_level(logging.WARNING):
        AdjacencyTable.load(path, 10, model_id="b")
    assert "built with model 'a'" in caplog.text


def test_update_matches_kernel_reference():
    adj = pytest.importorskip("vllm_specplug.kernels.adjacency")
    vocab, k = 500, 8
    tokens, topk = _random_rows(400, vocab, k, seed=7)
    tokens[::17] = -1  # padding entries are skipped by both
    ours = AdjacencyTable(vocab, k)
    ours.update(tokens, topk)
    ref = torch.full((vocab, k), UNTOUCHED, dtype=torch.int32)
    adj.adjacency_update_ref(ref, tokens, topk)
    assert torch.equal(ours.table, ref)
    assert torch.equal(ours.table, _dict_reference(vocab, k, tokens, topk))


@pytest.mark.slow  # loads transformers: ~10 s
def test_build_from_corpus_matches_model_topk(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.models.tiny import tiny_model_path

    model_dir = tiny_model_path()
    corpus = tmp_path / "c.txt"
    corpus.write_text("the river ran through the valley and the river was cold\n")
    table = build_from_corpus(model_dir, str(corpus), k=4, seq_len=5, batch_size=2, progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(corpus.read_text().rstrip("\n"))["input_ids"]  # one document per line
    want = AdjacencyTable(table.vocab_size, 4)
    with torch.inference_mode():
        for s in range(0, len(ids), 5):  # the same windows, one at a time
            win = torch.tensor([ids[s : s + 5]])
            if win.shape[1] >= 2:
                want.update(win[0], model(input_ids=win).logits[0].topk(4).indices)
    assert torch.equal(table.table, want.table)
    assert table.model_id == os.path.basename(model_dir)
