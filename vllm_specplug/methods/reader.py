"""`reader`: READER -- an EAGLE-3 tree plus one deep retrieval branch.

The tree of a step is ``eagle3_tree``'s (the same head, runtime and options)
with two deterministic paths merged in (READER, Alg. 1-3):

* **SearchPath** (widening, Alg. 2): under the root, ``d_search`` tokens
  found one at a time. At each level the key is the last ``l_suffix`` tokens
  of the context (history + the path so far); the tokens that followed it
  in the request's own tokens (a maintained n-gram index, READER's
  short-term trie) and in the suffix-array datastore (its long-term store)
  are ranked by their summed frequency and the top one is appended. A key
  found in neither loses its first token and is retried.
* **Deepening** (Alg. 3): from the node at depth ``min(2, d_draft)`` on the
  most probable draft path, the same search with the context extended by
  that path, ``d_deep`` tokens attached under the node.

The draft tree gets ``N - d_search - d_deep`` nodes first, then the two
paths; everything merges in a trie, so a path that repeats draft nodes
shares them, and the slots that frees go to the next-best draft nodes (the
paper keeps a fixed shape instead; vLLM's verifier takes any shape). Every
node is tagged ``eagle3``, ``search`` or ``deep`` so the engine's stats
count accepted tokens per source.

The paper's KV-cache rearrangement every 25 steps has no counterpart here:
vLLM's paged cache has no per-prompt padding, and the runner compacts the
accepted path after each step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from vllm_specplug.config import option_error
from vllm_specplug.engine.interface import ProposerContext, ProposerStats, StepRequest
from vllm_specplug.engine.stats import RunningStat
from vllm_specplug.engine.tree import DraftTree, TrieBuilder, normalize_tree
from vllm_specplug.sources.eagle3_drafter import Eagle3Drafter, Eagle3DrafterConfig
from vllm_specplug.sources.context_index import ContextIndex
from vllm_specplug.sources.sa_datastore import SuffixArrayStoreOptions, search_path


class ReaderConfig(Eagle3DrafterConfig, SuffixArrayStoreOptions):
    """The EAGLE-3 head's options, the datastore's (``datastore``: the
    long-term store; None searches the request's own tokens only) and
    READER's."""

    l_suffix: int = Field(default=6, ge=1, le=32)
    """Longest search key: the last ``l_suffix`` tokens of the context (the
    paper leaves it open; 6 keeps a key specific without missing most
    repeats)."""
    d_search: int = Field(default=8, ge=0, le=64)
    """Depth of the widening path under the root (0: none). Deeper than the
    draft tree, which is the point: search costs no head pass."""
    d_deep: int = Field(default=4, ge=0, le=64)
    """Depth of the deepening path under the depth-2 node of the best draft
    path (0: none; the paper enables it at small batches only)."""
    max_context_occurrences: int = Field(default=4096, ge=1)
    """Most occurrences of a key in the request's own tokens one lookup
    counts: the most recent ones."""
    index_max_tokens: int = Field(default=32768, ge=64)
    """Most recent tokens of a request that its own-token index holds
    (``sources/context_index``: about 1 KB per token at ``l_suffix`` 6);
    older ones are dropped, and the search no longer finds them."""
    context_weight: float = Field(default=1.0, gt=0.0)
    """Weight of a count from the request's own tokens against one from the
    datastore when the union is ranked (the paper: 1, plain frequency)."""

    def check_against(self, num_speculative_tokens: int) -> None:
        super().check_against(num_speculative_tokens)
        if num_speculative_tokens < 1 + self.d_search + self.d_deep:
            raise option_error(
                "num_speculative_tokens", f"must be >= draft nodes (at least 1) + "
                f"d_search ({self.d_search}) + d_deep ({self.d_deep}) for method 'reader'",
                num_speculative_tokens)


def _chain(tokens: list[int], shares: list[float], base: float, source: str) -> DraftTree:
    """A path as a tree, scored like the draft (cumulative log-confidence)."""
    scores = list(base + np.cumsum(np.log(np.maximum(shares, 1e-6)))) if shares else []
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)),
                     scores=[float(s) for s in scores], sources=[source] * len(tokens))


def _trie_node(trie: TrieBuilder, tokens: Sequence[int]) -> int:
    """The trie node reached from the root along ``tokens`` (0: the root)."""
    node = 0
    for t in tokens:
        node = trie._children[node][int(t)]
    return node


def reader_tree(history: list[int], draft: DraftTree | None, budget: int,
                cfg: ReaderConfig, search) -> tuple[DraftTree | None, dict[str, int]]:
    """One step's tree (Alg. 1, lines 5-13): the draft's best ``budget -
    d_search - d_deep`` nodes, the widening path under the root, the
    deepening path under the depth-``min(2, d_draft)`` node of the best
    draft path, then the rest of the draft into the slots merging freed.
    ``search(context, depth) -> (tokens, shares)`` is :func:`search_path`
    over the request's index and the store. Also returns the nodes each
    path added beyond what was already in the tree (-1: no path found)."""
    core_n = max(budget - cfg.d_search - cfg.d_deep, min(budget, 1))
    trie = TrieBuilder(budget)
    core = None
    added = {"search": -1, "deep": -1}  # -1: no path found
    if draft is not None and len(draft):
        core = normalize_tree(draft, core_n)  # best nodes, best path first
        trie.insert_tree(core)
    if cfg.d_search:
        path, shares = search(history, cfg.d_search)
        if path:
            added["search"] = trie.insert_tree(_chain(path, shares, 0.0, "search"))
    if cfg.d_deep and core is not None:
        best = core.first_path()
        d = min(2, len(best))
        path, shares = search(history + best.tokens[:d], cfg.d_deep)
        if path:
            base = best.scores[d - 1] if best.scores is not None else 0.0
            added["deep"] = trie.insert_tree(_chain(path, shares, base, "deep"),
                                             under=_trie_node(trie, best.tokens[:d]))
    if draft is not None:
        trie.insert_tree(draft)  # freed slots: the next-best draft nodes
    return (trie.build() if len(trie) else None), added


class ReaderProposer(Eagle3Drafter):
    name = "reader"
    config_cls = ReaderConfig

    def __init__(self, config: ReaderConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)  # the EAGLE-3 head and its runtime
        self.store = config.open_datastore(ctx.vocab_size, ctx.tokenizer_path)
        self.indexes: dict[str, ContextIndex] = {}
        self._search_time = RunningStat()
        self._counts = {"search_paths": 0, "search_nodes": 0, "deep_paths": 0,
                        "deep_nodes": 0}

    def add_request(self, req_id: str) -> None:
        super().add_request(req_id)
        self.indexes[req_id] = self._new_index()

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.indexes.pop(req_id, None)

    def _new_index(self) -> ContextIndex:
        return ContextIndex(self.config.l_suffix, self.config.index_max_tokens)

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        drafts = super().propose(batch)  # the head's best N-node trees
        t0 = time.perf_counter()
        out: list[DraftTree | None] = [None] * len(batch)
        # past the step's time budget a request keeps the head's tree alone
        for i in self.deadline.order(batch):
            r, d = batch[i], drafts[i]
            if r.budget > 0:
                out[i] = self._merge(r, d) if self.deadline.allows(r.req_id) else d
        self._search_time.add(time.perf_counter() - t0)
        return out

    def _search(self, r: StepRequest, context: Sequence[int], depth: int
                ) -> tuple[list[int], list[float]]:
        cfg: ReaderConfig = self.config
        index = self.indexes.get(r.req_id)
        if index is None:
            index = self.indexes[r.req_id] = self._new_index()
        index.sync(r.token_ids)
        return search_path(context, depth, cfg.l_suffix, index, self.store,
                           cfg.context_weight, cfg.max_lookup_rows,
                           cfg.max_context_occurrences)

    def _merge(self, r: StepRequest, draft: DraftTree | None) -> DraftTree | None:
        history = [int(t) for t in r.token_ids]
        tree, added = reader_tree(history, draft, r.budget, self.config,
                                  lambda ctx, depth: self._search(r, ctx, depth))
        for source, n in added.items():
            if n >= 0:
                self._counts[f"{source}_paths"] += 1
                self._counts[f"{source}_nodes"] += n
        return tree

    def stats(self) -> ProposerStats:
        """The EAGLE-3 drafter's stats, plus the search paths made and the
        nodes they added beyond the draft tree, and the search time."""
        s = super().stats()
        s.counters.update(self._counts)
        s.counters["deadline_skips"] = self.deadline.skipped
        s.gauges["search"] = self._search_time.as_ms()
        s.gauges["datastore_tokens"] = 0 if self.store is None else len(self.store)
        return s

    @classmethod
    def rates(cls, counters: dict[str, int]) -> dict[str, float]:
        steps = max(1, counters.get("draft_steps", 0))
        return {"search_nodes_per_step": counters.get("search_nodes", 0) / steps,
                "deep_nodes_per_step": counters.get("deep_nodes", 0) / steps}

