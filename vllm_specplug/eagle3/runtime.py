"""The EAGLE-3 head at serving time: per-request K/V state and tree drafting.

Pure torch (no vLLM). The head's math is :class:`~.model.Eagle3Draft`'s, its
decoder layer run in the fused form of :class:`~.draft_layer.DraftLayer`; what
this module adds is the incremental bookkeeping that its ``chain()`` (the slow
reference, which recomputes the whole prefix per call) does not have:

* **State per request**: the head's own K/V for positions ``0 .. n-1`` and
  the pre-norm output of row ``n-1`` (which predicts the first draft). Row
  ``p`` reads the target token ``x[p+1]`` and the target's aux features at
  ``p`` (vLLM's EAGLE-3 convention), so it can be computed as soon as the
  target has verified ``x[p+1]``. :meth:`Eagle3Runtime.extend` appends the rows
  of every step (prefill chunks, accepted paths, whichever method drafted),
  for all requests of the step in one batched pass. Tree nodes' K/V never
  enter the state: the next step rewrites their positions from real features.
* **Prefix store**: blocks served from vLLM's prefix cache produce no
  hidden states, so a request may start at ``verified_pos > 0``. The head's
  K/V at position ``p`` depends only on the tokens ``x[0..p+1]``, so finished
  blocks of ``BLOCK`` positions are kept in an LRU keyed by a chained hash of
  their token prefix; a request that starts (or resumes) past its state
  fills the gap from there. A block's last position also reads the token
  after the block, so a prefix shared up to exactly a block's end (the
  requests part right after it) finds no block under its own next token:
  the store then serves the block stored under another next token (a
  *near hit*, counted): one position of the request's head state read
  another token there, which can only make its drafts a little worse,
  never its output (every draft is verified), where refusing the request
  would stop its drafting altogether. If a block is missing the request is marked
  ``broken`` and drafts nothing until it ends (counted), never from a
  silently shorter state. The chain is a keyed blake2b (a key of this
  process's own, never sent anywhere) seeded by the request's tenant
  (:meth:`Eagle3Runtime.bind`), as vLLM puts ``cache_salt`` into its first
  block's hash: a block is found only by requests of the tenant that stored
  it, and no request can make its tokens collide with another tenant's
  block. A request without a tenant neither stores nor fills.
* **Tree drafting** (:meth:`Eagle3Runtime.draft`), EAGLE-2 style: from the
  root, expand the top-k frontier depth by depth, one head pass per depth
  over the frontier rows of every request at once; candidates are scored by
  cumulative log-probability (over the draft vocabulary); each request keeps
  its best ``budget`` nodes (ties to the shallower, so parents always come
  before children), emitted depth-first with the best child first, so the
  best path is the first path. A static mode expands a rank template
  (:class:`~vllm_specplug.sources.template.TreeTemplate`) instead.
* **Memory**: a state holds ``2 * kv_heads * head_dim`` values a position
  (:attr:`Eagle3Runtime.row_bytes`; 1.5 KiB for the reference model's
  float32 head). A state grows by doubling up to ``max_request_tokens``
  positions, and all states together take at most ``max_kv_bytes``; a
  request whose state would pass either stops drafting with the head until
  it ends (its state freed, counted as ``kv_capped``), and is verified
  as plain decoding. The prefix store holds at most ``store_tokens``
  positions (:attr:`Eagle3Runtime.store_bytes_max`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm_specplug.eagle3.draft_layer import DraftLayer
from vllm_specplug.eagle3.model import Eagle3Draft
from vllm_specplug.eagle3.screen import ScreenedLogits
from vllm_specplug.sources.template import TreeTemplate
from vllm_specplug.engine.stats import ema
from vllm_specplug.engine.tree import DraftTree

logger = logging.getLogger(__name__)

BLOCK = 16
"""Granularity of the prefix store; divides vLLM's block sizes (16, 128)."""

SOURCE = "eagle3"

INITIAL_POSITIONS = 256
"""Positions a new request's state is allocated with (it doubles from there)."""

LEVEL_JUMP = 2.0
"""Largest factor one measured drafting level may count against the
running estimate (``Eagle3Runtime._observe_level``)."""

DepthHook = Callable[[int, torch.Tensor], "torch.Tensor | None"]
"""``hook(depth, frontier_logp [B, m]) -> keep [B] bool | None``: called
before the frontier at ``depth`` (its cumulative log-probabilities; confidence
is their ``exp``) is expanded; requests with ``keep`` False stop there
(nothing deeper is drafted for them)."""


@dataclass
class _State:
    k: torch.Tensor  # [cap, nkv, hd]
    v: torch.Tensor
    n: int = 0
    out: torch.Tensor | None = None  # [H] pre-norm output of row n-1
    hashes: list[bytes] = field(default_factory=list)  # chained hash per finished block
    broken: bool = False
    tenant: str | None = None
    """Whose prefix-store blocks the state may read and write (``bind``)."""
    seed: bytes | None = None
    """The chain's start, from ``tenant``; None: no store (no tenant, or
    not bound)."""
    bound: bool = False


@dataclass
class RuntimeStats:
    extended_rows: int = 0
    head_rows: int = 0
    """Rows the head ran while drafting (frontier rows over all depths)."""
    head_passes: int = 0
    """Batched head passes while drafting (one per expanded depth, shared by
    the step's requests): what a GPU step's drafting latency scales with."""
    draft_calls: int = 0
    store_hits: int = 0
    store_near_hits: int = 0
    """Fills whose last block was stored under another next token."""
    store_misses: int = 0
    stopped_early: int = 0
    stopped_cost: int = 0
    """Requests that stopped deepening because the next level was worth
    less than its head pass (``draft(token_seconds=...)``)."""
    kv_capped: int = 0
    """Requests that stopped drafting because their state would have grown
    past ``max_request_tokens`` or all states past ``max_kv_bytes``."""


def _kv_layout(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v [B, S, nkv, hd]`` -> ``(k^T [B, nkv, hd, S], v [B, nkv, S, hd])``,
    the layout :func:`_attend` multiplies in (laid out once per key set, not
    per use: the context keys serve every drafting level)."""
    return k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)


def _attend(q: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            scale: float) -> torch.Tensor:
    """Batched attention over several key sets with one softmax.

    q ``[B, Q, nh, hd]``; each part ``(k^T [B, nkv, hd, S], v [B, nkv, S, hd],
    mask [B, Q, S])`` (see :func:`_kv_layout`). Query heads are grouped per KV
    head, so keys and values are never repeated per query head (on a CPU the
    repeat cost more than the products).
    """
    b, nq, nh, hd = q.shape
    nkv = parts[0][0].shape[1]
    rep = nh // nkv
    qg = q.reshape(b, nq, nkv, rep, hd).permute(0, 2, 1, 3, 4).reshape(b, nkv, nq * rep, hd)
    scores = []
    for kt, _, mask in parts:
        s = torch.matmul(qg, kt).mul_(scale).view(b, nkv, nq, rep, -1)
        scores.append(s.masked_fill_(~mask[:, None, :, None, :], float("-inf")))
    p = torch.softmax(torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0], dim=-1)
    p = p.view(b, nkv, nq * rep, -1)
    out, start = None, 0
    for _, v, _ in parts:
        o = torch.matmul(p[..., start:start + v.shape[2]], v)
        out = o if out is None else out.add_(o)
        start += v.shape[2]
    return out.view(b, nkv, nq, rep, hd).permute(0, 2, 1, 3, 4).reshape(b, nq, nh, hd)


class Eagle3Runtime:
    """Per-request head state plus batched tree drafting (see module doc)."""

    def __init__(self, head: Eagle3Draft, store_tokens: int = 1 << 16,
                 max_request_tokens: int | None = None,
                 max_kv_bytes: int | None = None, screen_lm_head: bool = False) -> None:
        """``max_request_tokens``: positions one request's state may hold;
        ``max_kv_bytes``: what all states together may take (None: no cap).
        ``store_tokens``: positions the prefix store keeps.
        ``screen_lm_head``: rank each level's tokens with the LM head's int8
        screen (``eagle3/screen.py``; CPU float32 heads only)."""
        self.head = head.eval()
        self.layer = DraftLayer(self.head)
        """The head's decoder layer in drafting's fused form (its linear
        layers are the ones to prepare for a fast GEMM, with ``fc`` and an
        unscreened ``lm_head``)."""
        self.screen = (ScreenedLogits.build(head.lm_head, head.norm) if screen_lm_head
                       else None)
        attn = head.midlayer.self_attn
        self.nkv, self.hd = attn.nkv, attn.hd
        self.scale = 1.0 / math.sqrt(attn.hd)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.row_bytes = 2 * self.nkv * self.hd * p.element_size()
        """Bytes of one position's K and V."""
        self.max_request_tokens = max_request_tokens
        self.max_kv_bytes = max_kv_bytes
        self.kv_bytes = 0
        """What every state's K/V buffers take now (allocated, not filled)."""
        self._caps_logged: set[str] = set()
        self.states: dict[str, _State] = {}
        self.store: OrderedDict[tuple[bytes, int], tuple[torch.Tensor, torch.Tensor]] = \
            OrderedDict()
        self._next_of: dict[bytes, int] = {}
        """A block hash's latest next token in the store (near hits)."""
        self._key = os.urandom(32)  # the store's hash key: this process's only
        self.store_blocks = max(0, store_tokens // BLOCK)
        self.store_bytes_max = self.store_blocks * BLOCK * self.row_bytes
        """The most the prefix store takes (its entries are ``BLOCK``
        positions each, at most ``store_blocks`` of them)."""
        self.stats = RuntimeStats()
        self.level_seconds: float | None = None
        """One drafting level's time (EMA; logits + top-k + a head pass),
        measured on CPU only: a GPU's launches are asynchronous, and its
        passes cost little next to a target step. Seeded by
        :meth:`warm_up`; each later level moves it by at most
        ``LEVEL_JUMP`` times (see ``_observe_level``)."""

    # ------------------------------------------------------------ lifecycle
    @torch.no_grad()
    def warm_up(self, depth: int, topk: int, rows: int = 2 * BLOCK) -> None:
        """Draft once from a throw-away state before serving, then forget it.

        The first calls of each GEMM shape pay one-time costs (oneDNN builds
        a primitive per row count: a first draft can take a hundred times
        its work). Measured as the first drafting level, that spike would
        make the cost-aware depth stop below every level from then on, and
        no later level would run to correct it: every head-drafting method
        would draft one level for good. The user's first request pays it
        otherwise, too."""
        width = self.head.fc.in_features
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.head.cfg["vocab_size"], (rows + 1,), generator=g).numpy()
        aux = torch.randn(rows, width, generator=g) * 0.1
        rid = "__specplug_warm_up__"
        saved, self.stats = self.stats, RuntimeStats()
        caps = self.max_request_tokens, self.max_kv_bytes
        self.max_request_tokens = self.max_kv_bytes = None  # a throw-away state
        try:
            self.add(rid)
            self.extend([(rid, 0, tokens, aux)])
            for _ in range(2):  # the second pass sees warm kernels only
                self.level_seconds = None
                self.draft([rid], [depth * topk], depth=min(depth, 3), topk=topk)
        finally:
            self.remove(rid)
            self.store.clear()  # its blocks (before serving, nothing else is there)
            self.stats = saved
            self.max_request_tokens, self.max_kv_bytes = caps

    def _observe_level(self, seconds: float) -> None:
        """One drafting level's time into ``level_seconds``: a sample counts
        at most ``LEVEL_JUMP`` times the estimate, so one slow level (a new
        shape's first call, the OS taking a core) cannot make every later
        level look unaffordable -- levels that never run never correct it."""
        old = self.level_seconds
        if old is not None:
            seconds = min(seconds, LEVEL_JUMP * old)
        self.level_seconds = ema(old, seconds, 0.2)

    def add(self, req_id: str) -> None:
        self.remove(req_id)
        self.states[req_id] = self._new_state()

    def remove(self, req_id: str) -> None:
        st = self.states.pop(req_id, None)
        if st is not None:
            self.kv_bytes -= self._held(st)

    def bind(self, req_id: str, tenant: str | None) -> None:
        """The request's tenant (``StepRequest.tenant``), before its rows
        are extended: the prefix store serves it only blocks its tenant
        stored, and None (share nothing) none at all. A state not bound
        stores and fills nothing. A tenant that changes mid-request turns
        the store off for the request (its chain was the other tenant's)."""
        st = self._state(req_id)
        if not st.bound:
            st.bound, st.tenant = True, tenant
            st.seed = None if tenant is None else self._digest(tenant.encode("utf-8",
                                                                            "surrogatepass"))
        elif st.tenant != tenant:
            st.tenant, st.seed = None, None

    def _new_state(self) -> _State:
        """An empty state, its first positions allocated within the caps
        (none when the other states take every byte ``max_kv_bytes``
        allows: it grows, or gives up, when rows arrive)."""
        st = _State(k=self._buffer(0), v=self._buffer(0))
        cap = INITIAL_POSITIONS
        if self.max_request_tokens is not None:
            cap = min(cap, self.max_request_tokens)
        if self.max_kv_bytes is None or self.kv_bytes + cap * self.row_bytes <= self.max_kv_bytes:
            self._resize(st, cap)
        return st

    def _state(self, req_id: str) -> _State:
        st = self.states.get(req_id)
        if st is None:
            st = self.states[req_id] = self._new_state()
        return st

    def _buffer(self, positions: int) -> torch.Tensor:
        return torch.empty(positions, self.nkv, self.hd, device=self.device, dtype=self.dtype)

    def _held(self, st: _State) -> int:
        return st.k.shape[0] * self.row_bytes

    def _resize(self, st: _State, positions: int) -> None:
        """Reallocate the state's buffers to ``positions``, keeping its rows."""
        self.kv_bytes += (positions - st.k.shape[0]) * self.row_bytes
        for name in ("k", "v"):
            old = getattr(st, name)
            buf = self._buffer(positions)
            buf[: st.n] = old[: st.n]
            setattr(st, name, buf)

    def _reserve(self, st: _State, n: int) -> bool:
        """Room for ``n`` positions (doubling, within the caps). False when
        the caps leave none: the state gave up (see ``_give_up``)."""
        cap = st.k.shape[0]
        if n <= cap:
            return True
        limit = self.max_request_tokens
        if limit is not None and n > limit:
            self._give_up(st, "max_request_tokens", f"{limit} positions for one request")
            return False
        new = max(n, 2 * cap) if limit is None else min(max(n, 2 * cap), limit)
        room = None if self.max_kv_bytes is None else self.max_kv_bytes - self.kv_bytes
        if room is not None and (new - cap) * self.row_bytes > room:
            new = n  # no doubling: only what the rows need
            if (new - cap) * self.row_bytes > room:
                self._give_up(st, "max_kv_bytes",
                              f"{self.max_kv_bytes / 2**20:.0f} MiB for every request")
                return False
        self._resize(st, new)
        return True

    def _break(self, st: _State) -> None:
        """The request drafts nothing with the head until it ends: its
        state's memory is freed now."""
        self.kv_bytes -= self._held(st)
        st.k, st.v = self._buffer(0), self._buffer(0)
        st.n, st.out, st.broken = 0, None, True
        st.hashes.clear()

    def _give_up(self, st: _State, cap: str, what: str) -> None:
        """The state would pass a memory cap: ``_break`` it (the request is
        verified as plain decoding from now on), counted and logged once."""
        self._break(st)
        self.stats.kv_capped += 1
        if cap not in self._caps_logged:
            self._caps_logged.add(cap)
            logger.warning("specplug: the EAGLE-3 head's K/V reached its cap (%s = %s); "
                           "requests past it decode without head drafts (counted as "
                           "kv_capped; logged once)", cap, what)

    def ready(self, req_id: str, num_tokens: int) -> bool:
        """The state covers the ``num_tokens - 1`` positions a draft after
        ``num_tokens`` verified tokens needs."""
        st = self.states.get(req_id)
        return (st is not None and not st.broken and st.out is not None
                and st.n == num_tokens - 1)

    # ------------------------------------------------------------ prefix store
    @property
    def store_bytes(self) -> int:
        """What the prefix store's entries take now."""
        return len(self.store) * BLOCK * self.row_bytes

    def _digest(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._key, digest_size=16).digest()

    def _block_key(self, st: _State, j: int, tokens: np.ndarray) -> tuple[bytes, int]:
        """Block ``j``'s store key: the keyed hash chained from the tenant's
        seed over every token up to the block's end, and the token after it
        (the block's last row reads it)."""
        prev = st.hashes[j - 1] if j > 0 else st.seed
        block = np.ascontiguousarray(tokens[j * BLOCK:(j + 1) * BLOCK], dtype="<i8")
        return self._digest(prev + block.tobytes()), int(tokens[(j + 1) * BLOCK])

    def _store_blocks(self, st: _State, tokens: np.ndarray) -> None:
        """Hash (and keep) every finished block of the state."""
        if st.seed is None:
            return
        while (len(st.hashes) + 1) * BLOCK <= st.n:
            j = len(st.hashes)
            key = self._block_key(st, j, tokens)
            st.hashes.append(key[0])
            if self.store_blocks == 0:
                continue
            if key in self.store:
                self.store.move_to_end(key)
            else:
                sl = slice(j * BLOCK, (j + 1) * BLOCK)
                self.store[key] = (st.k[sl].clone(), st.v[sl].clone())
                while len(self.store) > self.store_blocks:
                    (h, nxt), _ = self.store.popitem(last=False)
                    if self._next_of.get(h) == nxt:
                        del self._next_of[h]
            self._next_of[key[0]] = key[1]

    def _fill_from_store(self, st: _State, upto: int, tokens: np.ndarray) -> bool:
        """Bring the state to ``upto`` rows from the prefix store (only
        from blocks its own tenant stored)."""
        if st.seed is None:
            return False
        if st.n % BLOCK or upto % BLOCK or st.n != len(st.hashes) * BLOCK:
            return False
        near = False
        while st.n < upto:
            j = st.n // BLOCK
            key = self._block_key(st, j, tokens)
            if key not in self.store and st.n + BLOCK == upto and key[0] in self._next_of:
                key, near = (key[0], self._next_of[key[0]]), True  # see the module docstring
            kv = self.store.get(key)
            if kv is None:
                return False
            self.store.move_to_end(key)
            st.k[st.n:st.n + BLOCK], st.v[st.n:st.n + BLOCK] = kv
            st.hashes.append(key[0])  # never stored again from this state
            st.n += BLOCK
        self.stats.store_near_hits += near
        st.out = None
        return True

    # ------------------------------------------------------------ extension
    @torch.no_grad()
    def extend(self, items: Sequence[tuple[str, int, np.ndarray, torch.Tensor]]) -> None:
        """Append verified rows. Each item is ``(req_id, verified_pos,
        token_ids, aux)``: ``aux [n, n_aux*H]`` are the target's features at
        positions ``verified_pos .. verified_pos+n-1``; ``token_ids`` the
        verified history (it must reach ``verified_pos + n``, the input token
        of the last row)."""
        work = []
        for rid, pos, tokens, aux in items:
            n = int(aux.shape[0])
            st = self._state(rid)
            if st.broken or n == 0 or len(tokens) < pos + n + 1:
                continue
            if st.n > pos:  # recomputed rows (e.g. a resumed request): rewrite them
                st.n = pos
                del st.hashes[pos // BLOCK:]
                st.out = None
            if not self._reserve(st, pos + n):
                continue
            if st.n < pos:
                if self._fill_from_store(st, pos, tokens):
                    self.stats.store_hits += 1
                else:
                    self._break(st)
                    self.stats.store_misses += 1
                    continue
            work.append((st, pos, n, tokens, aux))
        if not work:
            return
        h = self.head
        toks = torch.as_tensor(np.concatenate([t[p + 1:p + 1 + n] for _, p, n, t, _ in work]),
                               dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(p, p + n) for _, p, n, _, _ in work]).to(self.device)
        hid = h.fc(torch.cat([a for *_, a in work]).to(self.device, self.dtype))
        q, k, v = self.layer.qkv(toks, hid, pos)
        starts = np.concatenate([[0], np.cumsum([w[2] for w in work])])
        for i, (st, p, n, _, _) in enumerate(work):
            st.k[p:p + n] = k[starts[i]:starts[i + 1]]
            st.v[p:p + n] = v[starts[i]:starts[i + 1]]
            st.n = p + n
        att = torch.empty_like(q)
        # Short extensions (decode steps) in one padded batch, long ones
        # (prefill chunks) alone so they do not pad everybody.
        short = [i for i, w in enumerate(work) if w[2] <= 32]
        groups = ([short] if short else []) + [[i] for i, w in enumerate(work) if w[2] > 32]
        for g in groups:
            if len(g) == 1:
                # one request: attend to its state in place (a decode step of
                # a lone request would otherwise copy its whole K/V per step)
                st, p, n = work[g[0]][:3]
                qb = q[starts[g[0]]:starts[g[0] + 1]][None]
                kb, vb = st.k[None, :st.n], st.v[None, :st.n]
                mask = (torch.arange(st.n, device=self.device)[None, :]
                        <= torch.arange(p, p + n, device=self.device)[:, None])[None]
            else:
                qmax = max(work[i][2] for i in g)
                smax = max(work[i][0].n for i in g)
                qb = q.new_zeros(len(g), qmax, *q.shape[1:])
                kb = q.new_zeros(len(g), smax, self.nkv, self.hd)
                vb = torch.zeros_like(kb)
                mask = torch.zeros(len(g), qmax, smax, dtype=torch.bool, device=self.device)
                for b, i in enumerate(g):
                    st, p, n = work[i][:3]
                    qb[b, :n] = q[starts[i]:starts[i + 1]]
                    kb[b, :st.n] = st.k[:st.n]
                    vb[b, :st.n] = st.v[:st.n]
                    mask[b, :n] = (torch.arange(smax, device=self.device)[None, :]
                                   <= torch.arange(p, p + n, device=self.device)[:, None])
            ob = _attend(qb, [(*_kv_layout(kb, vb), mask)], self.scale)
            for b, i in enumerate(g):
                att[starts[i]:starts[i + 1]] = ob[b, :work[i][2]]
        out = self.layer.post(att, hid)
        for i, (st, _, _, tokens, _) in enumerate(work):
            st.out = out[starts[i + 1] - 1].clone()
            self._store_blocks(st, tokens)
        self.stats.extended_rows += int(starts[-1])

    # ------------------------------------------------------------ drafting
    def _logp(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head.logits(out).float(), dim=-1)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.head.d2t[draft_ids]

    @torch.no_grad()
    def draft(self, req_ids: Sequence[str], budgets: Sequence[int], *, depth: int = 8,
              topk: int = 10, template: TreeTemplate | None = None,
              hook: DepthHook | None = None,
              token_seconds: Sequence[float] | None = None) -> list[DraftTree | None]:
        """One tree per request (None where the state is not ready or the
        budget is 0): at most ``budgets[i]`` nodes, at most ``depth`` deep
        (``template``: its shape instead of top-k/depth). Requests must be
        :meth:`ready`. ``DraftTree.scores`` are cumulative log-probabilities.

        ``token_seconds`` (per request, 0 = unknown): what one accepted token
        saves (``StepRequest.token_seconds``). A request then stops
        deepening once the next level is worth less than it costs: its best
        frontier node's probability (what the level can add at most, by the
        head's own scores) times ``token_seconds`` below the request's share
        of a level's measured time."""
        live = [i for i, (r, b) in enumerate(zip(req_ids, budgets))
                if b > 0 and r in self.states and self.states[r].out is not None
                and not self.states[r].broken]
        trees: list[DraftTree | None] = [None] * len(req_ids)
        if not live:
            return trees
        self.stats.draft_calls += 1
        sts = [self.states[req_ids[i]] for i in live]
        need = torch.tensor([budgets[i] for i in live], device=self.device)
        worth = None
        if token_seconds is not None and self.level_seconds is not None:
            worth = torch.tensor([float(token_seconds[i]) for i in live], device=self.device)
            if not bool((worth > 0).any()):
                worth = None
        cand = self._expand(sts, need, depth, topk, template, hook, worth)
        for j, i in enumerate(live):
            trees[i] = _select(cand, j, budgets[i])
        return trees

    def _expand(self, sts: list[_State], need: torch.Tensor, depth: int, topk: int,
                template: TreeTemplate | None, hook: DepthHook | None,
                token_seconds: torch.Tensor | None = None) -> dict:
        """Candidates of every request: tokens, cumulative log-probs, parent
        (candidate index, -1 = root), all ``[B, C]`` in depth order.

        Exact early stop: a node never scores above its parent, so once a
        request's best frontier score is no better than the ``need``-th best
        candidate it already has, nothing deeper can enter its tree."""
        ctx = self._context(sts)
        levels = None if template is None else _template_levels(template)
        max_depth = depth if template is None else template.depth
        width = topk if template is None else template.max_rank + 1
        front = _Frontier.at_root(sts, self.device)
        toks, scores, parents = [], [], []  # per depth [B, m]
        timed = self.device.type == "cpu"
        for d in range(1, max_depth + 1):
            t_level = time.perf_counter() if timed else 0.0
            kids = self._children(front, levels, d, width, topk)
            toks.append(kids.tok)
            scores.append(kids.score.masked_fill(~front.alive[:, None], float("-inf")))
            parents.append(kids.par)
            if d == max_depth or kids.nxt.shape[1] == 0:
                break
            kth = _kth_best(scores, need)
            if not self._keep_deepening(front.alive, kth, kids.nxt_score, d, hook,
                                        token_seconds):
                break
            if levels is None and hook is None:
                kids = _worth_expanding(kids, front.alive, kth)
            self._head_pass(front, ctx, d, kids)
            if timed:
                self._observe_level(time.perf_counter() - t_level)
        return _candidates(toks, scores, parents)

    def _context(self, sts: list[_State]) -> _Context:
        """The requests' states as one padded key set, laid out once for
        every level's attention (see ``_kv_layout``)."""
        dev = self.device
        n_ctx = torch.tensor([st.n for st in sts], device=dev)
        smax = int(n_ctx.max())
        if len(sts) == 1:  # no padding needed: lay the state out directly
            ctx_k, ctx_v = sts[0].k[None, :smax], sts[0].v[None, :smax]
        else:
            ctx_k = torch.zeros(len(sts), smax, self.nkv, self.hd, device=dev,
                                dtype=self.dtype)
            ctx_v = torch.zeros_like(ctx_k)
            for b, st in enumerate(sts):
                ctx_k[b, :st.n] = st.k[:st.n]
                ctx_v[b, :st.n] = st.v[:st.n]
        ctx_k, ctx_v = (x.contiguous() for x in _kv_layout(ctx_k, ctx_v))
        mask = (torch.arange(smax, device=dev)[None, :] < n_ctx[:, None])[:, None, :]
        return _Context(ctx_k, ctx_v, mask, n_ctx)

    def _children(self, front: _Frontier, levels: list | None, d: int, width: int,
                  topk: int) -> _Children:
        """Depth ``d``'s candidates (the children of the frontier) and which
        of them form the next frontier: the best ``topk`` overall (EAGLE-2),
        or the template's nodes that have children."""
        bsz = front.out.shape[0]
        if self.screen is not None:
            vals, ids = self.screen.top(front.out, width)  # [B, m, w]
        else:
            logp = self._logp(front.out)  # [B, m, Vd]
            vals, ids = logp.topk(min(width, logp.shape[-1]), dim=-1)
        cum = front.score[..., None] + vals
        if levels is None:
            par = front.cand[..., None].expand(-1, -1, vals.shape[-1]).reshape(bsz, -1)
            tok = self._to_target(ids).reshape(bsz, -1)
            score = cum.reshape(bsz, -1)
            nxt_score, nxt = score.topk(min(topk, score.shape[1]), dim=-1)
            return _Children(tok, score, par, nxt, nxt_score, nxt // vals.shape[-1])
        rows, ranks, expand_rows = levels[d - 1]
        par = front.cand[:, rows]
        tok = self._to_target(ids[:, rows, ranks])
        score = cum[:, rows, ranks]
        nxt = torch.as_tensor(expand_rows, device=self.device).expand(bsz, -1)
        nxt_score = score[:, nxt[0]] if len(expand_rows) else score[:, :0]
        nxt_row = torch.as_tensor(rows, device=self.device)[nxt] if len(expand_rows) else nxt
        return _Children(tok, score, par, nxt, nxt_score, nxt_row)

    def _keep_deepening(self, alive: torch.Tensor, kth: torch.Tensor,
                        nxt_score: torch.Tensor, d: int,
                        hook: DepthHook | None, token_seconds: torch.Tensor | None) -> bool:
        """Stop the requests that need no deeper level (``alive`` is updated
        in place), in order: the exact early stop (``kth``: see
        ``_kth_best``), the depth hook, the cost-aware depth. False once
        none is left (later stops are not asked then)."""
        alive &= ~(nxt_score.max(dim=-1).values <= kth)
        if not bool(alive.any()):
            return False
        if hook is not None:
            keep = hook(d, nxt_score)
            if keep is not None:
                stop = alive & ~keep.to(self.device)
                self.stats.stopped_early += int(stop.sum())
                alive &= keep.to(self.device)
                if not bool(alive.any()):
                    return False
        if token_seconds is not None:
            # cost-aware depth: a level costs level_seconds, shared by the
            # live requests; the next level adds at most its best frontier
            # node's probability in accepted tokens
            share = self.level_seconds / max(1, int(alive.sum()))
            gain = nxt_score.max(dim=-1).values.exp() * token_seconds
            stop = alive & (token_seconds > 0) & (gain < share)
            if bool(stop.any()):
                self.stats.stopped_cost += int(stop.sum())
                alive &= ~stop
                if not bool(alive.any()):
                    return False
        return True

    def _head_pass(self, front: _Frontier, ctx: _Context, d: int, kids: _Children) -> None:
        """One head pass over the next frontier's rows: each attends to its
        request's context and to its own ancestors in the tree; ``front``
        moves on to them."""
        dev = self.device
        bsz, k_new = kids.nxt.shape
        f_tok = kids.tok.gather(1, kids.nxt)
        out = front.out
        f_hid = out.gather(1, kids.nxt_row[..., None].expand(-1, -1, out.shape[-1]))
        pos = (ctx.n[:, None] + (d - 1)).expand(-1, k_new).reshape(-1)
        q, k, v = self.layer.qkv(f_tok.reshape(-1), f_hid.reshape(bsz * k_new, -1), pos)
        q = q.view(bsz, k_new, *q.shape[1:])
        k = k.view(bsz, k_new, *k.shape[1:])
        v = v.view(bsz, k_new, *v.shape[1:])
        eye = torch.eye(k_new, dtype=torch.bool, device=dev).expand(bsz, -1, -1)
        if front.anc is None:
            front.anc, front.tree_k, front.tree_v = eye, k, v
        else:
            # a frontier row sees its parent's ancestors and itself
            par_anc = front.anc.gather(
                1, kids.nxt_row[..., None].expand(-1, -1, front.anc.shape[-1]))
            front.anc = torch.cat([par_anc, eye], dim=-1)
            front.tree_k = torch.cat([front.tree_k, k], dim=1)
            front.tree_v = torch.cat([front.tree_v, v], dim=1)
        att = _attend(q, [(ctx.k, ctx.v, ctx.mask.expand(-1, k_new, -1)),
                          (*_kv_layout(front.tree_k, front.tree_v), front.anc)], self.scale)
        front.out = self.layer.post(att.reshape(bsz * k_new, *att.shape[2:]),
                                    f_hid.reshape(bsz * k_new, -1)).view(bsz, k_new, -1)
        self.stats.head_rows += int(front.alive.sum()) * k_new
        self.stats.head_passes += 1
        front.score = kids.nxt_score
        front.cand = kids.nxt + front.n_cand
        front.n_cand += kids.tok.shape[1]


def _kth_best(scores: list[torch.Tensor], need: torch.Tensor) -> torch.Tensor:
    """Per request, the ``need``-th best score among the candidates drafted
    so far (``scores``: per depth ``[B, m]``), or -inf while it has fewer:
    a node never scores above its parent, so nothing below a node that
    scores no better than this can enter the request's tree."""
    have = torch.cat(scores, dim=1)
    kth = have.topk(min(have.shape[1], int(need.max())), dim=-1).values
    kth = kth.gather(1, (need.clamp(max=kth.shape[1]) - 1)[:, None])[:, 0]
    return kth.masked_fill(need > have.shape[1], float("-inf"))


def _worth_expanding(kids: _Children, alive: torch.Tensor, kth: torch.Tensor) -> _Children:
    """The next frontier without the nodes no live request can use: those
    scoring no better than their request's ``kth`` (their subtrees cannot
    enter its tree; ties go to the shallower node, which is already there).
    The frontier is sorted best first, so the useful nodes are a prefix of
    each request's row and the batch keeps the longest prefix. Exact: the
    trees are those of the whole frontier; only the head rows of subtrees
    that could never be kept are skipped, and with a budget of a few nodes
    and a top-10 frontier those are most rows below the first level."""
    useful = alive[:, None] & (kids.nxt_score > kth[:, None])
    width = max(1, int(useful.sum(dim=1).max()))
    if width == kids.nxt.shape[1]:
        return kids
    return _Children(kids.tok, kids.score, kids.par, kids.nxt[:, :width],
                     kids.nxt_score[:, :width], kids.nxt_row[:, :width])


@dataclass
class _Context:
    """Every drafting request's state as one padded key set."""

    k: torch.Tensor  # k^T [B, nkv, hd, S]
    v: torch.Tensor  # [B, nkv, S, hd]
    mask: torch.Tensor  # [B, 1, S]: the positions each request has
    n: torch.Tensor  # [B] positions per request


@dataclass
class _Frontier:
    """The rows about to be expanded, and the tree drafted so far."""

    out: torch.Tensor  # [B, m, H] their head outputs
    score: torch.Tensor  # [B, m] cumulative log-probabilities
    cand: torch.Tensor  # [B, m] their candidate index (-1: the root)
    alive: torch.Tensor  # [B] requests still deepening
    tree_k: torch.Tensor | None = None  # tree rows' K/V, [B, rows, nkv, hd]
    tree_v: torch.Tensor | None = None
    anc: torch.Tensor | None = None  # [B, m, rows]: which tree rows a row sees
    n_cand: int = 0  # candidates before this frontier's children

    @classmethod
    def at_root(cls, sts: list[_State], device: torch.device) -> _Frontier:
        bsz = len(sts)
        return cls(out=torch.stack([st.out for st in sts])[:, None],
                   score=torch.zeros(bsz, 1, device=device),
                   cand=torch.full((bsz, 1), -1, dtype=torch.long, device=device),
                   alive=torch.ones(bsz, dtype=torch.bool, device=device))


@dataclass
class _Children:
    """One depth's candidates ``[B, c]`` and the next frontier ``[B, k]``."""

    tok: torch.Tensor  # target token ids
    score: torch.Tensor  # cumulative log-probabilities
    par: torch.Tensor  # parent candidate index (-1: the root)
    nxt: torch.Tensor  # which candidates are expanded next
    nxt_score: torch.Tensor
    nxt_row: torch.Tensor  # their parents' frontier rows


def _candidates(toks: list[torch.Tensor], scores: list[torch.Tensor],
                parents: list[torch.Tensor]) -> dict:
    """Per-depth candidates as ``[B, C]`` arrays in depth order."""
    depth_of = torch.cat([torch.full_like(t, i + 1) for i, t in enumerate(toks)], dim=1)
    return {"tokens": torch.cat(toks, 1).cpu().numpy(),
            "scores": torch.cat(scores, 1).cpu(),
            "parents": torch.cat(parents, 1).cpu().numpy(),
            "depths": depth_of.cpu().numpy()}


def _template_levels(template: TreeTemplate) -> list[tuple[list[int], list[int], list[int]]]:
    """Per depth: (frontier row of each node's parent, its rank, indices of
    the level's nodes that have children = the next frontier, in order)."""
    depths = template.depths
    has_child = {p for p in template.parents if p >= 0}
    levels, prev_nodes = [], [-1]
    for d in range(1, template.depth + 1):
        nodes = [i for i, dd in enumerate(depths) if dd == d]
        rows = [prev_nodes.index(template.parents[i]) for i in nodes]
        ranks = [template.ranks[i] for i in nodes]
        expand = [j for j, i in enumerate(nodes) if i in has_child]
        levels.append((rows, ranks, expand))
        prev_nodes = [nodes[j] for j in expand]
    return levels


def _select(cand: dict, b: int, budget: int) -> DraftTree | None:
    """The best ``budget`` candidates of request ``b`` as a tree, best path first."""
    scores = cand["scores"][b]
    # stable sort over depth-ordered candidates: ties go to the shallower node,
    # and a child never scores above its parent, so parents come first
    order = torch.sort(scores, descending=True, stable=True).indices.numpy()
    tokens, parents = cand["tokens"][b], cand["parents"][b]
    sc = scores.numpy()
    chosen: set[int] = set()
    for c in order:
        if len(chosen) >= budget or not np.isfinite(sc[c]):
            break
        if parents[c] < 0 or parents[c] in chosen:
            chosen.add(int(c))
    if not chosen:
        return None
    children: dict[int, list[int]] = {}
    for c in sorted(chosen, key=lambda c: -sc[c]):
        children.setdefault(int(parents[c]), []).append(c)
    out_tok, out_par, out_sc, index = [], [], [], {}
    stack = list(reversed(children.get(-1, [])))
    while stack:
        c = stack.pop()
        index[c] = len(out_tok)
        out_tok.append(int(tokens[c]))
        out_par.append(index[int(parents[c])] if parents[c] >= 0 else -1)
        out_sc.append(float(sc[c]))
        stack.extend(reversed(children.get(c, [])))
    return DraftTree(out_tok, out_par, scores=out_sc, sources=[SOURCE] * len(out_tok))
