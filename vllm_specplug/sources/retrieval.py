"""Retrieval from a request's own context (AdaPLD, PLD+): candidate
positions, reranking by hidden state, and the paths a draft tree is built
from.

Everything works on a ``ContextMemory`` (``sources/context_memory.py``):
the tokens of a request with what the target said about each position
(a layer's output, its top-k). Pieces:

- candidates: ``lexical_candidates`` (earlier positions holding the query
  token, optionally with a longer matching suffix), ``semantic_candidates``
  (positions whose token's input embedding is similar, via
  ``EmbeddingSimilarity`` and a per-request ``TokenVocab``);
- selection: ``rerank`` / ``best_per_group`` by the cosine of the prefix
  states (``state_vector``, ``prefix_scores``);
- paths: ``branch_tokens`` (the anchor's stored top-k), ``successor_paths``
  (the continuation after the best position holding each branch token);
- a tree: ``build_draft_tree`` merges main path, branches and successors
  within a budget; ``node_kinds`` labels its nodes.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.engine.tree import DraftTree, TrieBuilder
from vllm_specplug.sources.context_memory import ContextMemory, f16_to_f32

LEXICAL = "lexical"
SEMANTIC = "semantic"

# Node kinds of a draft tree (for the reuse-pattern statistics).
MAIN, BRANCH, SUCCESSOR = 0, 1, 2


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
        # of these small shapes can be 100x slower than a GEMV.
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
