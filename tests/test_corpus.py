"""vllm_specplug.corpus: the one corpus reader, chat renderer and
target-over-documents loop the offline builders share."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_specplug import corpus


def test_iter_texts_jsonl_and_txt(tmp_path):
    jl = tmp_path / "c.jsonl"
    rows = [
        {"text": "a b"},
        {"prompt": "c"},
        {"turns": ["d", {"content": "e"}, {"value": "f"}]},
        {"prompt": "q", "response": "r"},
        "plain",
    ]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    # No tokenizer: no chat template, contents joined by blank lines.
    assert list(corpus.iter_texts(str(jl))) == ["a b", "c", "d\n\ne\n\nf", "q\n\nr", "plain"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(corpus.iter_texts(str(bad)))
    txt = tmp_path / "c.txt"
    txt.write_text("one\ntwo\n\n\nthree\n")
    assert list(corpus.iter_texts(str(txt))) == ["one", "two", "three"]  # one per line
    assert list(corpus.iter_texts(str(txt), txt_docs="file")) == ["one\ntwo\n\n\nthree\n"]
    with pytest.raises(corpus.CorpusError, match="not found"):
        list(corpus.iter_texts(str(tmp_path / "missing.txt")))


def test_iter_prompts_ids_and_turns(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"id": "x", "turns": ["a", "b"]}) + "\n"
                  + json.dumps({"text": "t"}) + "\n")
    assert list(corpus.iter_prompts(str(jl))) == [("x", ["a", "b"]), ("1", ["t"])]


class _Tok:
    """A tokenizer with a trivial chat template (characters as ids)."""

    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def test_chat_renderer_template_and_plain():
    tok = _Tok()
    assert corpus.chat_text(tok, [corpus.user("hi")]) == "<user>hi<assistant>"
    assert corpus.chat_ids(tok, "hi") == [ord(c) for c in "<user>hi<assistant>"]
    tok.chat_template = None
    assert corpus.chat_ids(tok, "hi") == [0, ord("h"), ord("i")]
    assert corpus.chat_text(None, [corpus.user("a"), corpus.user("b")]) == "a\n\nb"


def test_run_target_batches_in_order_and_slices_each_document():
    docs = [[1, 2, 3], [4], [5, 6], list(range(7, 17))]
    calls = []

    def forward(ids, mask):
        calls.append((tuple(ids.shape), mask is None))
        return ids * 10, ids.unsqueeze(-1)

    out = list(corpus.run_target(forward, docs, chunk_tokens=6))
    assert [d for d, _ in out] == docs
    for d, (a, b) in out:
        assert a.tolist() == [10 * t for t in d] and b.shape == (len(d), 1)
    # 2 x 3 <= 6 tokens; [5, 6] would make 3 x 3; the long one travels alone.
    assert calls == [((2, 3), False), ((1, 2), True), ((1, 10), True)]
    assert [len(b) for b in corpus.batches([[0] * 10] * 5 + [[0] * 50], 30)] == [3, 2, 1]
    assert torch.is_tensor(out[0][1][0])
