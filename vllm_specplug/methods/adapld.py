"""`adapld`: AdaPLD, adaptive retrieval and reuse (Liu et al., 2026), model-free.

Two constructions share the paper's pieces (``sources/retrieval.py``):

- default (scored): the anchor is the longest suffix match of the context
  (up to ``lexical_ngram`` tokens, earliest occurrence: ``pld``'s pick), and
  the main path is ``pld``'s chain at full budget, so on copy steps the tree
  holds what ``pld`` would draft. Only when nothing longer than the query
  token matches does the paper's retrieval + rerank below choose the anchor
  (``rerank_single``), and the semantic fallback when nothing matches at
  all. Every node gets an acceptance estimate -- main node ``d``:
  ``P(first) * P(next)^(d-1)`` for the match length, learned from the
  verified history (``sources/copy_path.py``); a branch: ``(1 - P(first))``
  times its stored top-k probability (calibrated online); a successor
  token: its parent's times ``P(successor | parent)`` -- and the tree is
  cut best-first to the budget (``normalize_tree``). A long, confident copy
  keeps the budget; after a short or uncertain one the branches take the
  deep copy nodes' place. The scores also let a cost-aware budget cut it.
- ``paper_literal``: the paper as written, below (the ablation row).

The paper's construction, every step, for every request (section 3; ``t``
is the last token of the history, the one just sampled, which the target
has not read yet):

1. Retrieval (3.3), lexical first: the candidate anchors are the earlier
   positions ``j < t`` holding the query token ``x_t``. Only when there are
   none, semantic fallback: positions whose token's *input embedding* has
   cosine similarity above ``similarity_threshold`` with ``x_t``'s.
2. Selection (3.4), as in PLD+: rerank the candidates by
   ``cos(h_{j-1}, h_{t-1})`` on the output of decoder layer ``hidden_layer``
   (the prefix before the candidate vs the prefix before the query); the
   best one is the anchor.
3. Reuse (3.5): a main path copied from after the anchor (lexical anchors
   only); branch tokens from the target's top-k after the anchor, minus the
   main path's first token; successor drafting extends every branch ``b`` by
   the token after the best position holding ``b`` (same lexical-first rule,
   reranked by ``cos(h_{i-1}, h_anchor)``).
4. The paths are merged into one ``DraftTree`` (main path first, so it
   occupies consecutive slots) within ``num_speculative_tokens``; a chain
   when the request needs the chain verifier. The main path gets what the
   branches and successors leave (at least one node; a tight budget drops
   successors, then the lowest branches), so any budget >= 1 works.

What the target said about every position (layer output, top-k) is kept in
a ``ContextMemory`` per request (``sources/context_memory.py``).

Choices the paper leaves open are options (see ``AdaPLDConfig``): the
candidate cap, n-gram lexical matching (off: the paper matches the single
query token), a branch probability floor (off), the copy length (default:
what the budget leaves after the branches), successor length (1, as in the
paper) and whether successors use semantic fallback (on, as the paper
says), prompt top-k capture (on, so prompt anchors can branch), the memory
cap. Further choices, documented where they are made: candidates without a
usable prefix state rank last; ties go to the most recent position; if the
best anchor yields nothing to draft, the next one is tried; with
``chain_only`` the draft is the main path, or the best branch plus its
successor when there is no main path.

``stats()`` reports the paper's Table 10 retrieval outcomes plus acceptance
measured one step later from the verified history (incl. how often
semantic-fallback drafts get a token accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import Field

from vllm_specplug.config import MethodConfig, option_error
from vllm_specplug.engine.interface import (
    Needs,
    Proposer,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.tree import DraftTree, normalize_tree
from vllm_specplug.sources.context_memory import ContextMemory, ContextMemoryStore
from vllm_specplug.sources.copy_path import CopyConfidence, Rate, accepted_prefix
from vllm_specplug.sources.ngram import match
from vllm_specplug.sources.retrieval import (
    BRANCH,
    LEXICAL,
    MAIN,
    SEMANTIC,
    EmbeddingSimilarity,
    TokenVocab,
    branch_tokens,
    build_draft_tree,
    lexical_candidates,
    node_kinds,
    rerank,
    semantic_candidates,
    state_vector,
    successor_paths,
)

class AdaPLDConfig(MethodConfig):
    """Options of the ``adapld`` method."""

    hidden_layer: int | None = Field(default=None, ge=0)
    """Decoder layer (0-based) whose output reranks candidates. The paper
    (following PLD+) uses an early-middle layer, e.g. 9 of 32 for Vicuna-7B,
    13 of 40 for Vicuna-13B (HF ``hidden_states`` indices: index i is the
    output of decoder layer i-1 here). Default: ``num_hidden_layers // 3``.
    Checked against the model when the proposer is built."""
    similarity_threshold: float = Field(default=0.3, ge=0.0, lt=1.0)
    """Semantic fallback keeps positions whose token's input embedding has
    cosine similarity above this with the query token's (tau, Eq. 4). The
    paper sweeps 0.0-0.8: low to moderate values do alike, high ones lose
    reuse."""
    semantic_fallback: bool = True
    """Retrieve by token-embedding similarity when no position holds the
    query token (needs the target's input embeddings). False gives the
    paper's lexical-only ablation."""
    paper_literal: bool = False
    """The paper's construction, for ablations: anchors matched on the query
    token alone and reranked by hidden state, a main path of what the
    branches leave of the budget (``max_copy_len``), one successor token,
    nodes kept in build order. False (default): the longest suffix match
    anchors (the paper's single-token match + rerank only when nothing
    longer matches) and every node is scored, so a long confident copy
    keeps the budget and branches get it where the copy is short or
    uncertain (see the module docstring)."""
    lexical_ngram: int = Field(default=4, ge=1, le=16)
    """Longest context suffix (tokens) looked up for the anchor; the
    longest match wins, earliest occurrence first, as ``pld`` with
    ``prompt_lookup_max`` of this. ``paper_literal`` uses 1 (the query
    token alone)."""
    rerank_single: bool = True
    """When the longest match is the query token alone, pick the anchor
    among its occurrences by hidden-state rerank (the paper's selection)
    rather than the earliest one."""
    max_candidates: int = Field(default=64, ge=1, le=4096)
    """Most candidates reranked per retrieval: the most recent lexical
    matches, or the most similar (then most recent) semantic ones. Bounds
    the per-step cost; the paper reranks all."""
    max_lookup_tokens: int = Field(default=65536, ge=16)
    """Most recent tokens of the context the longest-suffix match searches
    (one vectorised scan per key length, so a step's cost grows with the
    context up to this); an earlier occurrence is not found. Candidate
    retrieval and successors search the request's memory
    (``memory_max_positions``) and rerank at most ``max_candidates``."""
    branch_width: int = Field(default=4, ge=0, le=64)
    """Top-k of the target's distribution after the anchor that branch
    tokens come from (k, Eq. 10); the main path's first token is removed, so
    there are k or k-1 branches. It is also the top-k the target captures.
    0 disables branches and successors."""
    branch_min_prob: float = Field(default=0.0, ge=0.0, le=1.0)
    """Skip branch tokens whose stored probability is below this (0: keep
    all, as in the paper)."""
    max_copy_len: int | None = Field(default=None, ge=1)
    """Most tokens of the main copy path (Eq. 8). None: the whole budget
    (scores decide what the branches get); with ``paper_literal``, what
    ``num_speculative_tokens`` leaves after the branch and successor nodes
    (at least 1)."""
    successor_drafting: bool = True
    """Extend each branch with reused successor tokens (3.5)."""
    successor_len: int = Field(default=2, ge=1, le=16)
    """Most tokens copied after the successor position (scored, so only
    the ones worth a node are kept). ``paper_literal`` copies 1."""
    successor_semantic: bool = True
    """Successor retrieval falls back to embedding similarity too, as the
    paper's 'same lexical-first backoff rule' says; False: lexical only."""
    prompt_topk: bool = True
    """Also capture the target's top-k at every prompt position, so anchors
    inside the prompt can branch. False saves the LM-head pass over the
    prompt; prompt anchors then only copy."""
    memory_max_positions: int = Field(default=8192, ge=16, le=1 << 22)
    """Most positions kept per request (hidden state, top-k, token). Past
    it, the oldest non-head positions are dropped."""
    memory_head_positions: int | None = Field(default=None, ge=0)
    """Leading positions of the request (the prompt head) that are never
    dropped; at most half of ``memory_max_positions``. None: an eighth of
    it (1024 of the default 8192)."""

    @property
    def topk(self) -> int:
        """Top-k the target must capture."""
        return self.branch_width

    @property
    def head_positions(self) -> int:
        """``memory_head_positions`` resolved."""
        if self.memory_head_positions is None:
            return self.memory_max_positions // 8
        return self.memory_head_positions

    @property
    def succ_len(self) -> int:
        """Successor tokens per branch (0: none)."""
        if not self.successor_drafting:
            return 0
        return 1 if self.paper_literal else self.successor_len

    @property
    def branch_nodes(self) -> int:
        """Largest number of tree nodes the branches and successors take."""
        return self.branch_width * (1 + self.succ_len)

    def copy_cap(self, num_speculative_tokens: int) -> int:
        """Most main-path tokens at this budget. Any budget >= 1 works: with
        ``paper_literal`` the main path keeps at least one node and a tight
        budget drops successors, then the lowest branches."""
        if self.max_copy_len is not None:
            return self.max_copy_len
        if self.paper_literal:
            return max(1, num_speculative_tokens - self.branch_nodes)
        return num_speculative_tokens

    def check_against(self, num_speculative_tokens: int) -> None:
        n = num_speculative_tokens
        if self.head_positions > self.memory_max_positions // 2:
            raise option_error(
                "memory_head_positions",
                f"must be <= memory_max_positions/2 ({self.memory_max_positions // 2})",
                self.memory_head_positions)
        if self.max_copy_len is not None and self.max_copy_len > n:
            raise option_error("max_copy_len", f"exceeds num_speculative_tokens={n}",
                               self.max_copy_len)


    def check_engine(self, vllm_config) -> None:
        """Before the engine starts: ``hidden_layer`` exists in the target."""
        resolve_layer(self.hidden_layer,
                      vllm_config.model_config.get_total_num_hidden_layers())


def resolve_layer(hidden_layer: int | None, num_hidden_layers: int) -> int:
    """The decoder layer to capture; a one-line error naming ``hidden_layer``."""
    if hidden_layer is None:
        if num_hidden_layers <= 0:
            raise option_error("hidden_layer",
                               "must be set: the target's number of decoder layers is unknown")
        return num_hidden_layers // 3
    if num_hidden_layers > 0 and hidden_layer >= num_hidden_layers:
        raise option_error(
            "hidden_layer", f"is out of range: the target has {num_hidden_layers} "
            f"decoder layers (0..{num_hidden_layers - 1})", hidden_layer)
    return hidden_layer


# ------------------------------------------------------------------ proposer


@dataclass
class _Draft:
    tree: DraftTree
    kinds: list[int]
    base_len: int
    source: str
    match_len: int = 0
    """Suffix match length of the main path (0: no main path / paper mode)."""
    branch_probs: dict[int, float] | None = None
    """Stored probability of each root branch token (scored drafts)."""


_COUNTERS = (
    "retrieval_attempts", "lexical_hits", "semantic_hits", "no_hits",
    "fallback_fires", "no_draft",
    "drafts_lexical", "drafts_semantic",
    "verified_lexical", "verified_semantic",
    "accepted_any_lexical", "accepted_any_semantic",
    "accepted_tokens_lexical", "accepted_tokens_semantic",
    "accepted_main", "accepted_branch", "accepted_branch_succ", "mismatch",
    "successor_lexical", "successor_semantic", "successor_none",
    "suffix_anchors", "rerank_anchors",
)


def _rate(a: int, b: int) -> float:
    return a / b if b else 0.0


class AdaPLDProposer(Proposer):
    name = "adapld"
    config_cls = AdaPLDConfig

    def __init__(self, config: AdaPLDConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        self.layer = resolve_layer(config.hidden_layer, ctx.num_hidden_layers)
        self.sim: EmbeddingSimilarity | None = None
        if config.semantic_fallback or (config.successor_semantic and config.successor_drafting
                                        and config.branch_width > 0):
            if ctx.embed_tokens is None:
                key = "semantic_fallback" if config.semantic_fallback else "successor_semantic"
                raise option_error(
                    key, "needs the target's input embeddings, which the runner did "
                    "not provide; set semantic_fallback and successor_semantic to false",
                    "true")
            self.sim = EmbeddingSimilarity(ctx.embed_tokens)
        self.copy_cap = config.copy_cap(ctx.num_speculative_tokens)
        # Evidence for the scores (learned from what the target verified).
        self.copy = CopyConfidence(config.lexical_ngram)
        self.branch_calib = Rate(1.0)  # accepted branch / sum of its stored prob
        self.succ_rate = Rate(0.5)  # successor token accepted | its parent was
        self.memories = ContextMemoryStore(
            ctx.hidden_size, config.topk, config.memory_max_positions,
            config.head_positions,
        )
        self._pending: dict[str, _Draft] = {}
        self._vocabs: dict[str, TokenVocab] = {}
        self.counters = dict.fromkeys(_COUNTERS, 0)

    def needs(self) -> Needs:
        cfg: AdaPLDConfig = self.config
        return Needs(
            hidden_layer=self.layer, topk=cfg.topk,
            prefill_topk=cfg.prompt_topk and cfg.topk > 0,
            rows_on_host=True,  # its context memory is a host array
        )

    def add_request(self, req_id: str) -> None:
        # State is created on first sight anyway (propose); a preempted
        # request was removed, so it comes back fresh.
        self.memories.get(req_id)

    def remove_request(self, req_id: str) -> None:
        self.memories.remove(req_id)
        self._pending.pop(req_id, None)
        self._vocabs.pop(req_id, None)

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        out: list[DraftTree | None] = [None] * len(batch)
        for i in self.deadline.order(batch):
            req = batch[i]
            mem = self.memories.get(req.req_id)
            mem.update(req.token_ids, req.verified_pos, req.layer_hidden,
                       req.topk_ids, req.topk_probs, req.topk_offset)
            self._feedback(req)
            # budget 0: the cost-aware gate (or the context's end) asks for
            # no draft, as does the step's spent time budget; the memory
            # above is still kept up to date
            if req.sampled and req.budget > 0 and self.deadline.allows(req.req_id):
                out[i] = self._draft(req, mem)
        return out

    # -------------------------------------------------------------- drafting

    def _vocab_of(self, req_id: str) -> TokenVocab | None:
        """The request's token table (synced lazily by the first semantic
        retrieval that needs it)."""
        if self.sim is None:
            return None
        vocab = self._vocabs.get(req_id)
        if vocab is None:
            vocab = self._vocabs[req_id] = TokenVocab(self.sim)
        return vocab

    def _retrieve(
        self, mem: ContextMemory, qslot: int, vocab: TokenVocab | None
    ) -> tuple[np.ndarray, str | None]:
        """The paper's retrieval (3.3): positions holding the query token,
        else semantically similar ones."""
        cfg: AdaPLDConfig = self.config
        c = self.counters
        c["retrieval_attempts"] += 1
        q = int(mem.tokens[qslot])
        cands = lexical_candidates(mem, q, qslot, cfg.max_candidates, 1, qslot)
        if len(cands):
            c["lexical_hits"] += 1
            return cands, LEXICAL
        if cfg.semantic_fallback and self.sim is not None:
            c["fallback_fires"] += 1
            cands = semantic_candidates(mem, np.array([q]), qslot, self.sim,
                                        cfg.similarity_threshold, cfg.max_candidates,
                                        vocab=vocab)[0]
            if len(cands):
                c["semantic_hits"] += 1
                return cands, SEMANTIC
        c["no_hits"] += 1
        return cands, None

    def _draft(self, req: StepRequest, mem: ContextMemory) -> DraftTree | None:
        qslot = mem.n - 1  # the last token (the tail always holds it)
        if req.budget <= 0 or qslot < 1:
            return None
        if self.config.paper_literal:
            return self._draft_paper(req, mem, qslot)
        return self._draft_scored(req, mem, qslot)

    def _paper_anchor(self, mem: ContextMemory, qslot: int, vocab: TokenVocab | None,
                      copy_cap: int) -> tuple[int, np.ndarray, list[int], str | None]:
        """The paper's retrieval + selection (3.3, 3.4): (anchor slot or -1,
        main path, branch tokens, source)."""
        cfg: AdaPLDConfig = self.config
        main = np.empty(0, dtype=np.int32)
        cands, source = self._retrieve(mem, qslot, vocab)
        if source is None:
            return -1, main, [], None
        qvec = state_vector(mem, qslot - 1) if mem.has_prev(np.array([qslot]))[0] else None
        ranked, _ = rerank(mem, cands, qvec)
        for a in ranked:  # the first anchor that yields anything to draft
            a = int(a)
            main = mem.continuation(a, copy_cap) if source == LEXICAL else main
            branches = branch_tokens(mem, a, cfg.branch_width,
                                     int(main[0]) if len(main) else -1,
                                     cfg.branch_min_prob, self.ctx.vocab_size)
            if len(main) or branches:
                return a, main, branches, source
        return -1, main, [], source

    def _draft_scored(self, req: StepRequest, mem: ContextMemory,
                      qslot: int) -> DraftTree | None:
        """Longest suffix match first; every node scored by its estimated
        chance of acceptance; the tree cut best-first to the budget."""
        cfg: AdaPLDConfig = self.config
        room = req.budget
        toks = req.token_ids
        vocab = self._vocab_of(req.req_id)
        skip = max(0, len(toks) - cfg.max_lookup_tokens)
        n, begins = match(toks[skip:], 1, cfg.lexical_ngram)
        begins = [skip + b for b in begins]
        if n >= 2 or (n == 1 and not cfg.rerank_single):
            # pld's pick: its chain is our main path, so on copy steps the
            # tree holds at least what pld would draft.
            self.counters["retrieval_attempts"] += 1
            self.counters["lexical_hits"] += 1
            self.counters["suffix_anchors"] += 1
            begin = begins[0]
            main = toks[begin : begin + min(room, self.copy_cap)]
            anchor = int(mem.slots_of(np.array([begin - 1]))[0])
            source = LEXICAL
            branches = [] if anchor < 0 else branch_tokens(
                mem, anchor, cfg.branch_width, int(main[0]), cfg.branch_min_prob,
                self.ctx.vocab_size)
        else:
            anchor, main, branches, source = self._paper_anchor(
                mem, qslot, vocab, min(room, self.copy_cap))
            if source is None:
                return None
            if anchor < 0:
                self.counters["no_draft"] += 1
                return None
            self.counters["rerank_anchors"] += 1
            n = 1 if len(main) else 0
        if req.chain_only:
            branches = [] if len(main) else branches[:1]
        succs = self._successors(mem, branches, anchor, vocab)
        probs = self._branch_probs(mem, anchor, branches)
        tree = self._scored_tree(main, n, branches, probs, succs)
        if req.chain_only:
            tree = tree.first_path() if len(tree) else tree
        tree = normalize_tree(tree, room)
        if not len(tree):
            self.counters["no_draft"] += 1
            return None
        self.counters[f"drafts_{source}"] += 1
        self._pending[req.req_id] = _Draft(
            tree, node_kinds(tree, int(main[0]) if len(main) else None),
            len(toks), source, n if len(main) else 0, probs)
        return tree

    def _successors(self, mem: ContextMemory, branches: list[int], anchor: int,
                    vocab: TokenVocab | None) -> list[np.ndarray]:
        """Successor drafting (3.5) for every branch, counted by source."""
        cfg: AdaPLDConfig = self.config
        if not cfg.succ_len or not branches:
            return []
        succs, srcs = successor_paths(
            mem, branches, anchor, cfg.succ_len, cfg.max_candidates,
            self.sim if cfg.successor_semantic else None, cfg.similarity_threshold, vocab)
        for s in srcs:
            self.counters[f"successor_{s or 'none'}"] += 1
        return succs

    def _branch_probs(self, mem: ContextMemory, anchor: int,
                      branches: list[int]) -> dict[int, float]:
        """The anchor's stored probability of each branch token."""
        if not branches:
            return {}
        ids = mem.topk_ids[anchor].tolist()
        probs = mem.topk_probs[anchor].astype(np.float32).tolist()
        table = dict(zip(ids, probs))
        return {b: float(table.get(b, 0.0)) for b in branches}

    def _scored_tree(self, main, n: int, branches: list[int], probs: dict[int, float],
                     succs: list[np.ndarray]) -> DraftTree:
        """Main path, branches and successors with per-node acceptance
        estimates: main node d = P(copy's first) * P(next)^(d-1); a branch
        = P(main's first fails) * calibrated stored probability; a successor
        token = its parent's score * P(successor | parent accepted)."""
        tokens: list[int] = [int(t) for t in main]
        parents = list(range(-1, len(tokens) - 1))
        scores = self.copy.scores(n, len(tokens))
        miss = 1.0 - scores[0] if tokens else 1.0
        kappa, q = self.branch_calib.value, self.succ_rate.value
        for i, b in enumerate(branches):
            s = miss * min(1.0, kappa * probs.get(b, 0.0))
            parent = -1
            for t in [b, *(succs[i] if i < len(succs) else ())]:
                tokens.append(int(t))
                parents.append(parent)
                scores.append(s)
                parent, s = len(tokens) - 1, s * q
        return DraftTree(tokens, parents, scores)

    def _draft_paper(self, req: StepRequest, mem: ContextMemory,
                     qslot: int) -> DraftTree | None:
        """The paper's construction (``paper_literal``)."""
        cfg: AdaPLDConfig = self.config
        room = req.budget
        vocab = self._vocab_of(req.req_id)
        anchor, main, branches, source = self._paper_anchor(mem, qslot, vocab, self.copy_cap)
        if source is None:
            return None
        if anchor < 0:
            self.counters["no_draft"] += 1
            return None
        if req.chain_only and len(main):
            branches = []
        elif req.chain_only:
            branches = branches[:1]
        succs = self._successors(mem, branches, anchor, vocab)
        tree = build_draft_tree(main, branches, succs, room, req.chain_only)
        if tree is None or not len(tree):
            self.counters["no_draft"] += 1
            return None
        self.counters[f"drafts_{source}"] += 1
        self._pending[req.req_id] = _Draft(
            tree, node_kinds(tree, int(main[0]) if len(main) else None),
            len(req.token_ids), source,
        )
        return tree

    # ------------------------------------------------------------ statistics

    def _feedback(self, req: StepRequest) -> None:
        """Score the previous draft of this request against what the target
        verified: the tokens after the draft's base are the accepted path
        plus one sampled token."""
        d = self._pending.pop(req.req_id, None)
        if d is None:
            return
        accepted_max = len(req.token_ids) - d.base_len - 1
        if accepted_max < 0:
            return
        truth = req.token_ids[d.base_len : d.base_len + accepted_max]
        node, matched = d.tree.follow(truth)
        if d.branch_probs is not None and req.draft_kept > 0:
            self._learn(d, truth, node, matched, min(req.draft_kept, len(d.tree)))
        c = self.counters
        c[f"verified_{d.source}"] += 1
        c[f"accepted_tokens_{d.source}"] += matched
        if matched:
            c[f"accepted_any_{d.source}"] += 1
            kind = d.kinds[node]
            c[("accepted_main", "accepted_branch", "accepted_branch_succ")[kind]] += 1
        else:
            c["mismatch"] += 1

    def _learn(self, d: _Draft, truth, node: int, matched: int, kept: int) -> None:
        """Update the score estimates from one verified scored draft (only
        its first ``kept`` nodes were verified)."""
        kinds = d.kinds[:kept]
        main_len = sum(1 for k in kinds if k == MAIN)
        if main_len:
            main = [d.tree.tokens[i] for i in range(kept) if kinds[i] == MAIN]
            self.copy.record(d.match_len, main_len, accepted_prefix(main, truth))
        main_hit = bool(main_len) and matched > 0 and d.kinds[node] == MAIN
        roots = [i for i in range(kept) if d.tree.parents[i] < 0 and kinds[i] == BRANCH]
        if roots and not main_hit:
            # calibrate the stored probabilities: accepted / expected
            self.branch_calib.add(
                1.0 if matched and d.kinds[node] != MAIN else 0.0,
                sum(d.branch_probs.get(d.tree.tokens[i], 0.0) for i in roots))
        if matched >= 1 and d.kinds[node] != MAIN:
            # successors tried under the accepted branch path
            tried_next = any(d.tree.parents[i] == node for i in range(kept))
            self.succ_rate.add(matched - 1, matched - 1 + int(tried_next))

    def stats(self) -> ProposerStats:
        """Retrieval and acceptance counters; the memory's size."""
        live = set(self.memories._mems) | set(self._pending) | set(self._vocabs)
        counters = {**self.counters, "deadline_skips": self.deadline.skipped}
        return ProposerStats(counters=counters, gauges={
            "live_memories": len(self.memories), "live_requests": len(live),
            "memory_bytes": self.memories.nbytes, **self.copy.snapshot(),
            "branch_calibration": round(self.branch_calib.value, 4),
            "successor_rate": round(self.succ_rate.value, 4)})

    @classmethod
    def rates(cls, c: dict) -> dict[str, float]:
        """The paper's Table 10 (lexical / semantic / no-hit rates over
        retrieval attempts, semantic recovery = semantic hits / lexical
        misses) and acceptance of the drafts one step later
        (``fallback_recovery_rate``: share of semantic-fallback drafts with
        at least one accepted token)."""
        attempts = c["retrieval_attempts"]
        misses = attempts - c["lexical_hits"]
        return {
            "lexical_hit_rate": _rate(c["lexical_hits"], attempts),
            "semantic_hit_rate": _rate(c["semantic_hits"], attempts),
            "no_hit_rate": _rate(c["no_hits"], attempts),
            "semantic_recovery": _rate(c["semantic_hits"], misses),
            "lexical_accept_rate": _rate(c["accepted_any_lexical"], c["verified_lexical"]),
            "fallback_recovery_rate": _rate(c["accepted_any_semantic"],
                                            c["verified_semantic"]),
            "mean_accepted_lexical": _rate(c["accepted_tokens_lexical"],
                                           c["verified_lexical"]),
            "mean_accepted_semantic": _rate(c["accepted_tokens_semantic"],
                                            c["verified_semantic"]),
        }
