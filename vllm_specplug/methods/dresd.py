"""`dresd`: Dense Retrieval for Speculative Decoding (Gritta et al., 2025).

Every step, the target's last hidden state at the last verified position
(the LM-head input that predicted the token just sampled) is z-scored,
PCA-reduced and L2-normalised with the datastore's statistics and looked up
in the datastore's ScaNN index, one batched query for all requests of the
step. Each neighbour's value is the ``N`` tokens that followed it in the
corpus; its first token plays the role of the token the target just sampled,
so drafts whose first token differs from it are dropped (the paper's
filter) and the rest, with that first token stripped, are merged into a
draft tree (shared prefixes shared) within ``num_speculative_tokens``.

Draft shape follows the paper's best settings (section 5.4): greedy requests
get few long drafts (3 x 20), sampled requests more, shorter ones (10 x 10).
Build a store with ``specplug datastore build-dense``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from pydantic import Field

from vllm_specplug.config import MethodConfig, option_error
from vllm_specplug.engine.stats import RunningStat
from vllm_specplug.engine.interface import (
    Needs,
    Proposer,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.tree import DraftTree, TrieBuilder

logger = logging.getLogger(__name__)


class DReSDConfig(MethodConfig):
    datastore: str
    """Folder of a dense datastore built for this target with
    ``specplug datastore build-dense`` (checked at startup: files, checksums,
    hidden size, vocab size, tokenizer)."""
    greedy_num_drafts: int = Field(default=3, ge=1, le=64)
    """Drafts merged into the tree for greedy requests (paper: 3)."""
    greedy_draft_len: int = Field(default=20, ge=1, le=256)
    """Tokens per draft for greedy requests (paper: 20). Capped by the
    store's ``n_next - 1`` (the first stored token is the filter)."""
    sampling_num_drafts: int = Field(default=10, ge=1, le=64)
    """Drafts merged into the tree for sampled requests (paper: 10)."""
    sampling_draft_len: int = Field(default=10, ge=1, le=256)
    """Tokens per draft for sampled requests (paper: 10)."""
    greedy_max_temperature: float = Field(default=0.0, ge=0.0)
    """Requests with ``temperature <=`` this use the greedy draft shape, the
    others the sampling shape."""
    num_candidates: int = Field(default=32, ge=1, le=1024)
    """Neighbours retrieved per query before the first-token filter and
    de-duplication; must be >= both ``*_num_drafts``."""
    leaves_to_search: int | None = Field(default=None, ge=1)
    """ScaNN partitions searched per query (tree indexes only); ``None``
    keeps the value the store was built with."""
    pre_reorder_num_neighbors: int | None = Field(default=None, ge=1)
    """ScaNN candidates rescored exactly (AH indexes); ``None`` keeps the
    store's value."""
    min_similarity: float = Field(default=-1.0, ge=-1.0, le=1.0)
    """Drop neighbours whose cosine similarity to the query is below this
    (-1 keeps all)."""
    verify_checksums: bool = True
    """Check the SHA-256 of every datastore file at startup, in the front end
    and again on the bytes the engine loads into memory; ``False`` checks
    sizes only."""
    datastore_sha256: str | None = None
    """SHA-256 of the store's ``manifest.json`` the engine must find. The
    front end fills it in after checking the store, so the engine serves the
    store that was checked or refuses to start; set it to pin a store."""

    def check_against(self, num_speculative_tokens: int) -> None:
        for key in ("greedy_num_drafts", "sampling_num_drafts"):
            if getattr(self, key) > self.num_candidates:
                raise option_error(key, f"exceeds num_candidates={self.num_candidates}",
                                   getattr(self, key))


    def check_engine(self, vllm_config) -> None:
        """Before the engine starts: the store opens and fits the target
        (files, sizes, checksums, hidden size, vocabulary, tokenizer)."""
        from vllm_specplug.datastore.dense import (DatastoreError, DenseDatastore,
                                                   tokenizer_fingerprint)
        from vllm_specplug.datastore.manifest import pin_manifest

        mc = vllm_config.model_config
        try:
            store = DenseDatastore.open(
                self.datastore, expect_hidden_size=mc.get_hidden_size(),
                expect_vocab_size=mc.get_vocab_size(),
                expect_tokenizer_hash=tokenizer_fingerprint(mc.tokenizer),
                verify_checksums=self.verify_checksums,
                expect_manifest_sha256=self.datastore_sha256)
        except DatastoreError as e:
            raise option_error("datastore", str(e)) from None
        pin_manifest(vllm_config, store.manifest_sha256)


class DReSDProposer(Proposer):
    name = "dresd"
    config_cls = DReSDConfig

    def __init__(self, config: DReSDConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        from vllm_specplug.datastore.dense import DenseDatastore, tokenizer_fingerprint

        self.store = DenseDatastore.open(
            config.datastore,
            expect_hidden_size=ctx.hidden_size,
            expect_vocab_size=ctx.vocab_size,
            expect_tokenizer_hash=tokenizer_fingerprint(ctx.tokenizer_path),
            verify_checksums=config.verify_checksums,
            expect_manifest_sha256=config.datastore_sha256,
        )
        max_len = self.store.n_next - 1
        self._shape_greedy = (config.greedy_num_drafts, min(config.greedy_draft_len, max_len))
        self._shape_sampling = (config.sampling_num_drafts,
                                min(config.sampling_draft_len, max_len))
        for key, want in (("greedy_draft_len", config.greedy_draft_len),
                          ("sampling_draft_len", config.sampling_draft_len)):
            if want > max_len:
                logger.warning("dresd: %s=%d capped at %d (datastore n_next=%d)",
                               key, want, max_len, self.store.n_next)
        self._query = RunningStat()
        self._counts = {"steps": 0, "queries": 0, "neighbours": 0, "dropped_first_token": 0,
                        "dropped_similarity": 0, "duplicates": 0, "drafts": 0,
                        "draft_tokens": 0, "no_hidden": 0, "empty": 0}

    def needs(self) -> Needs:
        return Needs(hidden=True)

    def shape_for(self, req: StepRequest) -> tuple[int, int]:
        """``(num_drafts, draft_len)`` for a request, by its temperature."""
        if req.temperature <= self.config.greedy_max_temperature:
            return self._shape_greedy
        return self._shape_sampling

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        cfg: DReSDConfig = self.config
        out: list[DraftTree | None] = [None] * len(batch)
        rows: list[int] = []
        hidden: list[torch.Tensor] = []
        for i, req in enumerate(batch):
            if req.budget <= 0:
                continue
            if req.hidden is None or req.hidden.shape[0] == 0:
                self._counts["no_hidden"] += 1
                continue
            # Last row = state after reading the last accepted input token,
            # i.e. the one whose logits produced token_ids[-1].
            hidden.append(req.hidden[-1])
            rows.append(i)
        if not rows:
            return out
        # one device->host copy for the batch, not one per request
        queries = torch.stack(hidden).detach().float().cpu().numpy()
        self._counts["steps"] += 1
        self._counts["queries"] += len(rows)
        t0 = time.perf_counter()
        seqs, scores = self.store.query(
            queries, cfg.num_candidates, leaves_to_search=cfg.leaves_to_search,
            pre_reorder_num_neighbors=cfg.pre_reorder_num_neighbors)
        self._query.add(time.perf_counter() - t0)
        for j, i in enumerate(rows):
            out[i] = self._tree(batch[i], seqs[j], scores[j])
        return out

    def _tree(self, req: StepRequest, seqs: np.ndarray, scores: np.ndarray) -> DraftTree | None:
        c = self._counts
        num_drafts, draft_len = self.shape_for(req)
        room = req.budget
        last = req.last_token
        drafts: list[np.ndarray] = []
        seen: set[bytes] = set()
        for seq, score in zip(seqs, scores):
            if seq[0] < 0:
                break  # no more neighbours
            c["neighbours"] += 1
            if score < self.config.min_similarity:
                c["dropped_similarity"] += 1
                continue
            if seq[0] != last:
                c["dropped_first_token"] += 1
                continue
            cont = seq[1 : 1 + draft_len]
            end = np.flatnonzero(cont < 0)
            if end.size:
                cont = cont[: end[0]]
            if cont.size == 0:
                continue
            key = cont.tobytes()
            if key in seen:
                c["duplicates"] += 1
                continue
            seen.add(key)
            drafts.append(cont)
            if len(drafts) >= num_drafts or req.chain_only:
                break
        if not drafts:
            c["empty"] += 1
            return None
        if req.chain_only:
            tree = DraftTree.chain(drafts[0][:room].tolist())
        else:
            trie = TrieBuilder(room)
            for d in drafts:
                trie.insert(d)
            tree = trie.build()
        c["drafts"] += len(drafts)
        c["draft_tokens"] += len(tree)
        return tree

    def stats(self) -> ProposerStats:
        """Query latency (per step, one batched ScaNN call) and draft counters."""
        return ProposerStats(counters=dict(self._counts), gauges={
            "query": self._query.as_ms(),
            "live_requests": 0,  # no per-request state
            "store": {"path": self.store.path, "keys": len(self.store),
                      "index": self.store.index["kind"]}})
