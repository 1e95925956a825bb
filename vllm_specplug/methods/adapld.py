"""`adapld`: AdaPLD, adaptive retrieval and reuse (Liu et al., 2026), model-free.

Every step, for every request (the paper's section 3; ``t`` is the last
token of the history, the one just sampled, which the target has not read
yet):

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
   when the request needs the chain verifier.

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
import torch
from pydantic import Field

from vllm_specplug.config import MethodConfig, SpecplugConfigError
from vllm_specplug.engine.interface import (
    Needs,
    Proposer,
    ProposerContext,
    StepRequest,
)
from vllm_specplug.engine.tree import DraftTree, TrieBuilder
from vllm_specplug.sources.context_memory import (
    ContextMemory,
    ContextMemoryStore,
    f16_to_f32,
)

LEXICAL = "lexical"
SEMANTIC = "semantic"

# Node kinds of a draft tree (for the reuse-pattern statistics).
MAIN, BRANCH, SUCCESSOR = 0, 1, 2


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
    lexical_ngram: int = Field(default=1, ge=1, le=16)
    """Prefer lexical anchors whose preceding tokens also match: keep only
    the candidates with the longest common suffix, up to this many tokens.
    1 (the paper) matches the query token alone."""
    max_candidates: int = Field(default=64, ge=1, le=4096)
    """Most candidates reranked per retrieval: the most recent lexical
    matches, or the most similar (then most recent) semantic ones. Bounds
    the per-step cost; the paper reranks all."""
    branch_width: int = Field(default=4, ge=0, le=64)
    """Top-k of the target's distribution after the anchor that branch
    tokens come from (k, Eq. 10); the main path's first token is removed, so
    there are k or k-1 branches. It is also the top-k the target captures.
    0 disables branches and successors."""
    branch_min_prob: float = Field(default=0.0, ge=0.0, le=1.0)
    """Skip branch tokens whose stored probability is below this (0: keep
    all, as in the paper)."""
    max_copy_len: int | None = Field(default=None, ge=1)
    """Most tokens of the main copy path (Eq. 8). None: what
    ``num_speculative_tokens`` leaves after the branch and successor nodes."""
    successor_drafting: bool = True
    """Extend each branch with reused successor tokens (3.5)."""
    successor_len: int = Field(default=1, ge=1, le=16)
    """Tokens copied after the successor position (the paper copies 1)."""
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
    def branch_nodes(self) -> int:
        """Largest number of tree nodes the branches and successors take."""
        succ = self.successor_len if self.successor_drafting else 0
        return self.branch_width * (1 + succ)

    def check_against(self, num_speculative_tokens: int) -> None:
        n = num_speculative_tokens
        if self.head_positions > self.memory_max_positions // 2:
            raise SpecplugConfigError(
                f"speculative_config['memory_head_positions']="
                f"{self.memory_head_positions} must be <= memory_max_positions/2 "
                f"({self.memory_max_positions // 2})"
            )
        if self.max_copy_len is not None and self.max_copy_len > n:
            raise SpecplugConfigError(
                f"speculative_config['max_copy_len']={self.max_copy_len} "
                f"exceeds num_speculative_tokens={n}"
            )
        main = self.max_copy_len or 1
        if self.branch_nodes + main > n:
            succ = self.successor_len if self.successor_drafting else 0
            raise SpecplugConfigError(
                f"speculative_config['branch_width']={self.branch_width}: the "
                f"tree needs {self.branch_nodes} branch/successor nodes "
                f"(successor_len={succ}) + {main} main-path node(s) > "
                f"num_speculative_tokens={n}; lower branch_width or successor_len, "
                f"or raise num_speculative_tokens"
            )


    def check_engine(self, vllm_config) -> None:
        """Before the engine starts: ``hidden_layer`` exists in the target."""
        resolve_layer(self.hidden_layer,
                      vllm_config.model_config.get_total_num_hidden_layers())


def resolve_layer(hidden_layer: int | None, num_hidden_layers: int) -> int:
    """The decoder layer to capture; a one-line error naming ``hidden_layer``."""
    if hidden_layer is None:
        if num_hidden_layers <= 0:
            raise SpecplugConfigError(
                "speculative_config['hidden_layer'] must be set: the target's "
                "number of decoder layers is unknown"
            )
        return num_hidden_layers // 3
    if num_hidden_layers > 0 and hidden_layer >= num_hidden_layers:
        raise SpecplugConfigError(
            f"speculative_config['hidden_layer']={hidden_layer} is out of range: "
            f"the target has {num_hidden_layers} decoder layers "
            f"(0..{num_hidden_layers - 1})"
        )
    return hidden_layer


# ---------------------------------------------------------------- retrieval


class EmbeddingSimilarity:
    """Cosine similarity between tokens' input embeddings, computed only for
    the rows asked for: with torch on the matrix's device (GPU), in numpy on
    CPU (rows of an fp32/fp16 matrix gathered through a zero-copy view).

    ``rows`` returns unit-norm fp32 rows in that backend; ``sims`` compares
    such rows with query tokens."""

    def __init__(self, embed_tokens: torch.Tensor, chunk: int = 8192) -> None:
        self.embed = embed_tokens.detach()
        self.on_cpu = self.embed.device.type == "cpu"
        vocab = self.embed.shape[0]
        inv = torch.empty(vocab, dtype=torch.float32, device=self.embed.device)
        for i in range(0, vocab, chunk):
            norms = torch.linalg.vector_norm(self.embed[i : i + chunk].float(), dim=1)
            inv[i : i + chunk] = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
        self.inv_norm = inv
        self._np = None
        if self.on_cpu:
            self._np_inv = inv.numpy()
            if self.embed.dtype in (torch.float32, torch.float16):
                self._np = self.embed.numpy()

    def rows(self, tokens: np.ndarray):
        """Unit-norm fp32 embeddings of ``tokens``."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not self.on_cpu:
            t = torch.from_numpy(tokens).to(self.embed.device)
            return self.embed.index_select(0, t).float() * self.inv_norm[t][:, None]
        if self._np is not None:
            r = self._np.take(tokens, axis=0)  # a copy
            r = f16_to_f32(r) if r.dtype == np.float16 else r
        else:  # e.g. bf16: numpy has no such dtype
            r = self.embed[torch.from_numpy(tokens)].float().numpy()
        r *= self._np_inv[tokens][:, None]
        return r

    def sims(self, rows, queries: np.ndarray) -> np.ndarray:
        """``[len(rows), len(queries)]`` fp32 cosine of ``rows()`` output
        with the query tokens' embeddings."""
        q = self.rows(queries)
        if not self.on_cpu:
            return (rows @ q.T).cpu().numpy()
        # One matrix-vector product per query: on busy cores a threaded GEMM
        # of these small shapes was measured 100x slower than a GEMV.
        out = np.empty((len(rows), len(q)), dtype=np.float32)
        for i in range(len(q)):
            out[:, i] = rows @ q[i]
        return out

    def cosine(self, cands: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """``[len(cands), len(queries)]`` fp32 cosine similarities."""
        return self.sims(self.rows(cands), queries)


class TokenVocab:
    """The distinct tokens a request's memory has held, with their unit-norm
    input embeddings, kept across steps and grown with the new tokens, so a
    semantic retrieval is one matrix-vector product over them instead of a
    gather of scattered embedding rows (on CPU; on GPU the rows are gathered
    on the device per call, which is cheap there).

    Tokens that left the memory stay until the table holds more than twice
    the memory's positions; then it is rebuilt from the memory. Footprint on
    CPU: 4 * hidden bytes per distinct token (2.3 KB for hidden 576)."""

    def __init__(self, sim: EmbeddingSimilarity) -> None:
        self.sim = sim
        self._keep_rows = sim.on_cpu
        self.reset()

    def reset(self) -> None:
        self.tokens = np.empty(0, dtype=np.int64)
        """Distinct tokens in row order."""
        self._sorted = np.empty(0, dtype=np.int64)
        self._row_of_sorted = np.empty(0, dtype=np.int64)
        self._rows = None
        self._seen = 0  # memory positions absorbed
        self._epoch = -1
        self._slot_rows_key = None
        self._slot_rows = None

    def __len__(self) -> int:
        return len(self.tokens)

    def sync(self, mem: ContextMemory) -> None:
        """Absorb the tokens ``mem`` got since the last call."""
        if (mem.epoch != self._epoch or mem.total < self._seen
                or len(self.tokens) > 2 * mem.n + 256):
            self.reset()
            self._add(mem.tokens[: mem.n])
            self._epoch = mem.epoch
        elif mem.total > self._seen:
            slots = mem.slots_of(np.arange(self._seen, mem.total))
            self._add(mem.tokens[slots[slots >= 0]])
        self._seen = mem.total

    def _add(self, toks: np.ndarray) -> None:
        toks = np.unique(np.asarray(toks, dtype=np.int64))
        if len(self._sorted):
            pos = np.minimum(np.searchsorted(self._sorted, toks), len(self._sorted) - 1)
            toks = toks[self._sorted[pos] != toks]
        if not len(toks):
            return
        first = len(self.tokens)
        self.tokens = np.concatenate([self.tokens, toks])
        at = np.searchsorted(self._sorted, toks)
        self._sorted = np.insert(self._sorted, at, toks)
        self._row_of_sorted = np.insert(self._row_of_sorted, at,
                                        np.arange(first, first + len(toks)))
        if self._keep_rows:
            new = self.sim.rows(toks)
            if self._rows is None or len(self._rows) < len(self.tokens):
                cap = max(len(self.tokens), 2 * (0 if self._rows is None else len(self._rows)), 64)
                rows = np.empty((cap, new.shape[1]), dtype=np.float32)
                if self._rows is not None:
                    rows[:first] = self._rows[:first]
                self._rows = rows
            self._rows[first : len(self.tokens)] = new

    def row_ids(self, toks: np.ndarray) -> np.ndarray:
        """Row of each token (all must be in the table)."""
        return self._row_of_sorted[np.searchsorted(self._sorted, toks)]

    def slot_rows(self, mem: ContextMemory, limit: int) -> np.ndarray:
        """Row of the token of every slot ``< limit`` (cached until the memory
        or the table changes: the retrievals of one step share it)."""
        key = (mem.epoch, mem.total, mem.n, limit, len(self.tokens))
        if self._slot_rows_key != key:
            self._slot_rows = self.row_ids(mem.tokens[:limit])
            self._slot_rows_key = key
        return self._slot_rows

    def sims(self, queries: np.ndarray) -> np.ndarray:
        """``[len(self), len(queries)]`` cosine of every row with the queries."""
        rows = self._rows[: len(self.tokens)] if self._keep_rows else self.sim.rows(self.tokens)
        return self.sim.sims(rows, queries)


def lexical_candidates(
    mem: ContextMemory,
    token: int,
    limit: int,
    max_candidates: int,
    ngram: int = 1,
    query_slot: int | None = None,
    need_next: bool = False,
) -> np.ndarray:
    """Slots ``< limit`` holding ``token``, most recent first, at most
    ``max_candidates``. With ``ngram > 1`` only the candidates sharing the
    longest suffix (up to ``ngram`` tokens, ending at ``query_slot``) are
    kept. ``need_next``: only slots with a stored successor token."""
    cands = np.flatnonzero(mem.tokens[:limit] == token)[::-1]
    if need_next and len(cands):
        cands = cands[mem.has_next(cands)]
    if ngram > 1 and len(cands) > 1 and query_slot is not None:
        cands = _longest_suffix(mem, cands, query_slot, ngram)
    return cands[:max_candidates]


def _longest_suffix(mem: ContextMemory, cands: np.ndarray, q: int, ngram: int) -> np.ndarray:
    length = np.ones(len(cands), dtype=np.int64)
    alive = np.ones(len(cands), dtype=bool)
    cur = cands.copy()
    for _ in range(1, ngram):
        if not mem.has_prev(np.array([q]))[0]:
            break
        q -= 1
        alive &= mem.has_prev(cur)
        cur = np.where(alive, cur - 1, 0)
        alive &= mem.tokens[cur] == mem.tokens[q]
        if not alive.any():
            break
        length += alive
    return cands[length == length.max()]


def semantic_candidates(
    mem: ContextMemory,
    queries: np.ndarray,
    limit: int,
    sim: EmbeddingSimilarity,
    threshold: float,
    max_candidates: int,
    need_next: bool = False,
    vocab: TokenVocab | None = None,
) -> list[np.ndarray]:
    """Per query token: slots ``< limit`` whose token's embedding has cosine
    similarity ``> threshold`` with the query's (the query token itself
    excluded), most similar first then most recent, at most
    ``max_candidates``. ``vocab``: the request's ``TokenVocab`` (synced
    here), else a throwaway one is built."""
    queries = np.asarray(queries, dtype=np.int64)
    if limit <= 0:
        return [np.empty(0, dtype=np.int64) for _ in queries]
    if vocab is None:
        vocab = TokenVocab(sim)
    vocab.sync(mem)
    sims = vocab.sims(queries)  # [rows, Q]
    good_any = (sims > threshold).any(axis=1)
    out = [np.empty(0, dtype=np.int64) for _ in queries]
    if not good_any.any():
        return out
    rows = vocab.slot_rows(mem, limit)  # row of every slot's token
    slot_ok = mem.has_next(np.arange(limit)) if need_next else None
    for qi, q in enumerate(queries):
        good = (sims[:, qi] > threshold) & (vocab.tokens != q)
        if not good.any():
            continue
        mask = good[rows]
        if slot_ok is not None:
            mask &= slot_ok
        slots = np.flatnonzero(mask)
        if len(slots) > 1:
            key = sims[rows[slots], qi]
            slots = slots[np.lexsort((-slots, -key))]
        out[qi] = slots[:max_candidates]
    return out


def state_vector(mem: ContextMemory, slot: int) -> np.ndarray | None:
    """Unit-norm fp32 layer output stored at ``slot`` (None if missing)."""
    if slot < 0 or not mem.has_hidden[slot]:
        return None
    return mem.hidden_f32(slot) * mem.inv_norm[slot]


def prefix_scores(
    mem: ContextMemory, cands: np.ndarray, query_vec: np.ndarray | None
) -> np.ndarray:
    """``cos(h[c - 1], query_vec)`` per candidate slot (Eqs. 6, 13); -2 where
    the prefix state is missing (or there is no query state)."""
    cands = np.asarray(cands, dtype=np.int64)
    scores = np.full(len(cands), -2.0, dtype=np.float32)
    if query_vec is not None and len(cands):
        prev = cands - 1
        ok = mem.has_prev(cands)
        ok[ok] = mem.has_hidden[prev[ok]]
        if ok.any():
            p = prev[ok]
            scores[ok] = (mem.hidden_f32(p) @ query_vec) * mem.inv_norm[p]
    return scores


def rerank(
    mem: ContextMemory, cands: np.ndarray, query_vec: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Sort candidates by ``prefix_scores``, best first. Candidates without
    a stored prefix state come last; ties keep the input order (most recent
    / most similar first)."""
    cands = np.asarray(cands, dtype=np.int64)
    scores = prefix_scores(mem, cands, query_vec)
    order = np.argsort(-scores, kind="stable")
    return cands[order], scores[order]


def best_per_group(
    mem: ContextMemory, groups: list[np.ndarray], query_vec: np.ndarray | None
) -> list[int]:
    """``rerank``'s winner of each candidate group (-1 for an empty group),
    scoring all groups with one gather."""
    sizes = [len(g) for g in groups]
    if not sum(sizes):
        return [-1] * len(groups)
    scores = prefix_scores(mem, np.concatenate(groups), query_vec)
    out, start = [], 0
    for g, n in zip(groups, sizes):
        out.append(int(g[np.argmax(scores[start : start + n])]) if n else -1)
        start += n
    return out


# ------------------------------------------------------------- construction


def branch_tokens(
    mem: ContextMemory,
    anchor: int,
    width: int,
    exclude: int = -1,
    min_prob: float = 0.0,
    vocab_size: int | None = None,
) -> list[int]:
    """The anchor's stored top-``width`` next tokens, most probable first,
    minus ``exclude`` (the main path's first token, Eq. 11), invalid ids,
    tokens below ``min_prob`` and duplicates."""
    if width <= 0 or not mem.has_topk[anchor]:
        return []
    ids = mem.topk_ids[anchor, :width]
    probs = mem.topk_probs[anchor, :width].astype(np.float32)
    out: list[int] = []
    for i in np.argsort(-probs, kind="stable"):
        tok = int(ids[i])
        if (tok < 0 or tok == exclude or probs[i] < min_prob or tok in out
                or (vocab_size is not None and tok >= vocab_size)):
            continue
        out.append(tok)
    return out


def successor_paths(
    mem: ContextMemory,
    branches: list[int],
    anchor: int,
    length: int,
    max_candidates: int,
    sim: EmbeddingSimilarity | None = None,
    threshold: float = 1.0,
    vocab: TokenVocab | None = None,
) -> tuple[list[np.ndarray], list[str | None]]:
    """Successor drafting (Eqs. 13-15): for each branch token ``b`` the
    ``length`` tokens after the best position holding ``b`` (lexical first,
    semantic fallback if ``sim`` is given), ranked by the prefix state before
    the position vs the anchor's state. Returns (tokens, source) per
    branch; empty tokens / None source when nothing is found."""
    k = len(branches)
    conts: list[np.ndarray] = [np.empty(0, dtype=np.int32)] * k
    sources: list[str | None] = [None] * k
    if not k:
        return conts, sources
    limit = mem.n - 1  # a successor position needs a following token
    anchor_vec = state_vector(mem, anchor)
    # All branches' lexical matches in one pass over the memory.
    slots, which = np.nonzero(mem.tokens[:limit, None] == np.asarray(branches)[None, :])
    keep = mem.has_next(slots)
    slots, which = slots[keep], which[keep]
    groups = []
    for i in range(k):
        groups.append(slots[which == i][::-1][:max_candidates])  # most recent first
    best = best_per_group(mem, groups, anchor_vec)
    missing = [i for i in range(k) if best[i] < 0]
    for i in range(k):
        if best[i] >= 0:
            conts[i], sources[i] = mem.continuation(best[i], length), LEXICAL
    if missing and sim is not None:
        sem = semantic_candidates(
            mem, np.array([branches[i] for i in missing]), limit, sim,
            threshold, max_candidates, need_next=True, vocab=vocab,
        )
        for i, b in zip(missing, best_per_group(mem, sem, anchor_vec)):
            if b >= 0:
                conts[i], sources[i] = mem.continuation(b, length), SEMANTIC
    return conts, sources


def build_draft_tree(
    main,
    branches: list[int],
    successors: list,
    room: int,
    chain_only: bool = False,
) -> DraftTree | None:
    """Merge the paths into a tree of at most ``room`` nodes.

    The main path goes first (consecutive slots) but leaves room for one
    node per branch plus its successors; then every branch token, then the
    successors (so a tight budget drops successors before branches). With
    ``chain_only``: the main path, else the best branch and its successor.
    """
    main = [int(t) for t in main]
    successors = list(successors) + [()] * (len(branches) - len(successors))
    if room <= 0:
        return None
    if chain_only:
        if main:
            path = main
        elif branches:
            path = [branches[0], *map(int, successors[0])]
        else:
            return None
        return DraftTree.chain(path[:room])
    if not main and not branches:
        return None
    reserved = sum(1 + len(s) for s in successors[: len(branches)])
    trie = TrieBuilder(room)
    if main:
        trie.insert(main[: max(1, room - reserved)])
    for b in branches:
        trie.insert([b])
    for b, s in zip(branches, successors):
        if len(s):
            trie.insert([b, *map(int, s)])
    return trie.build()


def node_kinds(tree: DraftTree, main_first: int | None) -> list[int]:
    """MAIN / BRANCH / SUCCESSOR per node: main-path nodes descend from the
    main path's first token, which no branch shares."""
    kinds: list[int] = []
    for tok, p in zip(tree.tokens, tree.parents):
        if p < 0:
            kinds.append(MAIN if tok == main_first else BRANCH)
        else:
            kinds.append(MAIN if kinds[p] == MAIN else SUCCESSOR)
    return kinds


# ------------------------------------------------------------------ proposer


@dataclass
class _Draft:
    tree: DraftTree
    kinds: list[int]
    base_len: int
    source: str


_COUNTERS = (
    "retrieval_attempts", "lexical_hits", "semantic_hits", "no_hits",
    "fallback_fires", "no_draft",
    "drafts_lexical", "drafts_semantic",
    "verified_lexical", "verified_semantic",
    "accepted_any_lexical", "accepted_any_semantic",
    "accepted_tokens_lexical", "accepted_tokens_semantic",
    "accepted_main", "accepted_branch", "accepted_branch_succ", "mismatch",
    "successor_lexical", "successor_semantic", "successor_none",
)


def _rate(a: int, b: int) -> float:
    return a / b if b else 0.0


class AdaPLDProposer(Proposer):
    name = "adapld"
    config_cls = AdaPLDConfig

    def __init__(self, config: AdaPLDConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        config.check_against(ctx.num_speculative_tokens)
        self.layer = resolve_layer(config.hidden_layer, ctx.num_hidden_layers)
        self.sim: EmbeddingSimilarity | None = None
        if config.semantic_fallback or (config.successor_semantic and config.successor_drafting
                                        and config.branch_width > 0):
            if ctx.embed_tokens is None:
                key = "semantic_fallback" if config.semantic_fallback else "successor_semantic"
                raise SpecplugConfigError(
                    f"speculative_config['{key}']=true needs the target's input "
                    f"embeddings, which the runner did not provide; set "
                    f"semantic_fallback and successor_semantic to false"
                )
            self.sim = EmbeddingSimilarity(ctx.embed_tokens)
        self.copy_cap = config.max_copy_len or max(
            1, ctx.num_speculative_tokens - config.branch_nodes
        )
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
        out: list[DraftTree | None] = []
        for req in batch:
            mem = self.memories.get(req.req_id)
            mem.update(req.token_ids, req.verified_pos, req.layer_hidden,
                       req.topk_ids, req.topk_probs)
            self._feedback(req)
            out.append(self._draft(req, mem) if req.sampled else None)
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
        cfg: AdaPLDConfig = self.config
        c = self.counters
        c["retrieval_attempts"] += 1
        q = int(mem.tokens[qslot])
        cands = lexical_candidates(mem, q, qslot, cfg.max_candidates,
                                   cfg.lexical_ngram, qslot)
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
        cfg: AdaPLDConfig = self.config
        room = min(self.ctx.num_speculative_tokens,
                   self.ctx.max_model_len - len(req.token_ids))
        qslot = mem.n - 1  # the last token (the tail always holds it)
        if room <= 0 or qslot < 1:
            return None
        vocab = self._vocab_of(req.req_id)
        cands, source = self._retrieve(mem, qslot, vocab)
        if source is None:
            return None
        qvec = state_vector(mem, qslot - 1) if mem.has_prev(np.array([qslot]))[0] else None
        ranked, _ = rerank(mem, cands, qvec)
        main = np.empty(0, dtype=np.int32)
        branches: list[int] = []
        anchor = -1
        for a in ranked:  # the first anchor that yields anything to draft
            a = int(a)
            main = mem.continuation(a, self.copy_cap) if source == LEXICAL else main
            branches = branch_tokens(mem, a, cfg.branch_width,
                                     int(main[0]) if len(main) else -1,
                                     cfg.branch_min_prob, self.ctx.vocab_size)
            if len(main) or branches:
                anchor = a
                break
        if anchor < 0:
            self.counters["no_draft"] += 1
            return None
        if req.chain_only and len(main):
            branches = []
        elif req.chain_only:
            branches = branches[:1]
        succs: list[np.ndarray] = []
        if cfg.successor_drafting and branches:
            succs, srcs = successor_paths(
                mem, branches, anchor, cfg.successor_len, cfg.max_candidates,
                self.sim if cfg.successor_semantic else None, cfg.similarity_threshold,
                vocab,
            )
            for s in srcs:
                self.counters[f"successor_{s or 'none'}"] += 1
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
        children = d.tree.children()
        node, matched = -1, 0
        for tok in req.token_ids[d.base_len : d.base_len + accepted_max]:
            nxt = next((ch for ch in children[node + 1] if d.tree.tokens[ch] == tok), None)
            if nxt is None:
                break
            node, matched = nxt, matched + 1
        c = self.counters
        c[f"verified_{d.source}"] += 1
        c[f"accepted_tokens_{d.source}"] += matched
        if matched:
            c[f"accepted_any_{d.source}"] += 1
            kind = d.kinds[node]
            c[("accepted_main", "accepted_branch", "accepted_branch_succ")[kind]] += 1
        else:
            c["mismatch"] += 1

    def stats(self) -> dict[str, float]:
        """Counters plus rates: the paper's Table 10 (lexical / semantic /
        no-hit rates over retrieval attempts, semantic recovery = semantic
        hits / lexical misses) and acceptance of the drafts one step later
        (``fallback_recovery_rate``: share of semantic-fallback drafts with
        at least one accepted token)."""
        live = set(self.memories._mems) | set(self._pending) | set(self._vocabs)
        return {**self.counters, "live_memories": len(self.memories),
                "live_requests": len(live),
                "memory_bytes": self.memories.nbytes, **self.rates(self.counters)}

    @staticmethod
    def rates(c: dict) -> dict[str, float]:
        """The rates of :meth:`stats` from its counters (also from counter
        differences, e.g. over one benchmark suite)."""
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
