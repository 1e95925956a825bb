"""A suffix-array datastore (``specplug datastore build-sa``) as a source of
draft paths: the options that name and check it, opening it, and READER's
search (SearchPath) over it and a request's own tokens.

``reader`` searches the store and the request's own-token index together;
``auto`` drafts the store's path as a source of its own (the request's own
tokens are its copy source already).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from vllm_specplug.config import MethodConfig, option_error
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.context_index import ContextIndex
from vllm_specplug.sources.suffix_array import TokenSuffixArray


class SuffixArrayStoreOptions(MethodConfig):
    """The datastore options a method that searches one shares."""

    datastore: str | None = None
    """Suffix-array datastore folder (``specplug datastore build-sa``,
    built with the target's tokenizer) that drafts are searched in; None:
    no datastore."""
    max_lookup_rows: int = Field(default=16384, ge=2)
    """Most datastore rows one lookup reads. A key with more matches (a
    short, common one) is read at this many evenly spaced rows; a
    continuation's count is still exact when it follows the key at least
    ``matches / (max_lookup_rows - 1)`` times, and rarer ones are left out
    (``TokenSuffixArray.next_token_counts``). Bounds a step's search cost:
    one lookup per drafted token at most, per request."""
    verify_checksums: bool = True
    """Hash the datastore's files at start-up, in the front end and again on
    the bytes the engine loads into memory (slow for a store of GBs);
    ``False`` checks sizes only."""
    datastore_sha256: str | None = None
    """SHA-256 of the store's ``manifest.json`` the engine must find. The
    front end fills it in after checking the store, so the engine serves the
    store that was checked or refuses to start; set it to pin a store."""

    def check_engine(self, vllm_config) -> None:
        """Before the engine starts: the datastore opens and was built with
        this model's tokenizer (files, sizes, checksums, vocabulary)."""
        super().check_engine(vllm_config)
        if self.datastore is not None:
            from vllm_specplug.datastore.manifest import pin_manifest

            mc = vllm_config.model_config
            store = open_store(self.datastore, mc.get_vocab_size(), mc.tokenizer,
                               self.verify_checksums, self.datastore_sha256)
            pin_manifest(vllm_config, store.manifest_sha256)

    def open_datastore(self, vocab_size: int, tokenizer: str | None) -> TokenSuffixArray | None:
        """The store these options name, checked as ``check_engine`` did
        (and pinned to the manifest it found), or None."""
        if self.datastore is None:
            return None
        return open_store(self.datastore, vocab_size, tokenizer, self.verify_checksums,
                          self.datastore_sha256)


def open_store(path: str, vocab_size: int, tokenizer: str | None,
               verify: bool, manifest_sha256: str | None = None) -> TokenSuffixArray:
    """Open the store at ``path``; a bad one is a one-line error naming the
    ``datastore`` option."""
    from vllm_specplug.datastore.dense import DatastoreError
    from vllm_specplug.datastore.suffix_array import open_sa_datastore

    try:
        return open_sa_datastore(os.path.expanduser(path), vocab_size=vocab_size,
                                 tokenizer=tokenizer, verify_checksums=verify,
                                 expect_manifest_sha256=manifest_sha256)
    except DatastoreError as e:
        raise option_error("datastore", str(e)) from None


def search_path(context: Sequence[int], depth: int, l_suffix: int,
                index: ContextIndex | None, store: TokenSuffixArray | None,
                context_weight: float = 1.0, max_rows: int | None = None,
                max_occurrences: int | None = None) -> tuple[list[int], list[float]]:
    """READER's SearchPath (Alg. 2): up to ``depth`` tokens continuing
    ``context``, and each one's share of its level's counts (a confidence).
    At each level the key is the context's last ``l_suffix`` tokens (the
    path so far included); a key found nowhere loses its first token and
    is retried. ``max_rows`` / ``max_occurrences`` bound one lookup's work
    in the store / the index.

    ``index`` must hold keys of ``l_suffix`` tokens (``max_n >= l_suffix``)
    and be synced to the request's history (a prefix of ``context``).
    Ties in the union go to the token seen in the context, then the
    smaller id. Without an index only the last ``l_suffix`` tokens of
    ``context`` are read."""
    ctx = [int(t) for t in context[-l_suffix:]] if index is None else \
        [int(t) for t in context]
    path, shares = [], []
    for _ in range(depth):
        best = None
        for n in range(min(l_suffix, len(ctx)), 0, -1):
            key = ctx[len(ctx) - n:]
            counts: dict[int, float] = {}
            if index is not None:
                for t, c in index.next_token_counts(key, max_occurrences).items():
                    counts[t] = context_weight * c
            if store is not None:
                ids, cnt = store.next_token_counts(key, max_rows)
                for t, c in zip(ids.tolist(), cnt.tolist()):
                    counts[t] = counts.get(t, 0.0) + c
            if counts:
                # stable: context tokens were inserted first
                best = max(counts.items(), key=lambda kv: kv[1])
                total = sum(counts.values())
                break
        if best is None:
            break
        path.append(best[0])
        shares.append(best[1] / total)
        ctx.append(best[0])
    return path, shares


def path_tree(tokens: list[int], shares: list[float]) -> DraftTree:
    """A searched path as a chain claimed by its cumulative share (the
    chance of each token given the one before, multiplied down the path)."""
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)),
                     scores=[float(s) for s in np.cumprod(shares)])
