"""Which prompts a datastore was built from.

``specplug datastore build-dense/build-sa --suites`` store the target's own
greedy answers to a suite's prompts. Measured on those same prompts, a
retrieval method copies the very answer it is about to produce and its
acceptance says nothing about other prompts. So the builders write the SHA-1
of each prompt text beside the store (``<store>.prompts.json``), and the
benchmark harness refuses to measure a method whose datastore holds any
prompt it is about to send (:func:`overlap`).
"""

from __future__ import annotations

import hashlib
import json
import os

SUFFIX = ".prompts.json"


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def list_path(store: str) -> str:
    return os.path.expanduser(store).rstrip("/") + SUFFIX


def record(store: str, texts: list[str], suites: list[str]) -> str:
    """Write the prompt list of ``store`` (built from ``texts`` of ``suites``)."""
    path = list_path(store)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"suites": suites, "sha1": sorted({_digest(t) for t in texts})}, f)
    return path


def overlap(store: str, suites) -> dict[str, int] | None:
    """``{suite name: how many of its measured prompts the store holds}``
    (suites with none left out); None when the store has no prompt list."""
    try:
        with open(list_path(store), encoding="utf-8") as f:
            held = set(json.load(f)["sha1"])
    except (OSError, ValueError, KeyError):
        return None
    out = {}
    for s in suites:
        n = sum(1 for t in s.used_texts if _digest(t) in held)
        if n:
            out[s.name] = n
    return out
