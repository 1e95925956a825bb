"""Per-request context memory: tokens plus what the target said about them.

For every position of a request's history (prompt + output) the memory keeps
the token id and, once the target has read that token, the output of one
decoder layer (16-bit) and the target's top-k next-token ids/probabilities.
Reuse-based methods (PLD+, AdaPLD) retrieve anchor positions from it, rerank
them by hidden-state similarity and draft from the tokens and top-k stored
there.

Layout. Everything lives in preallocated numpy arrays indexed by *slot*; no
per-token Python objects. The arrays start small and double up to the cap.

Cap and eviction (prompt head + recent tail). At most ``max_positions``
positions are kept: the first ``head_positions`` positions of the request
(the head of the prompt: instructions, the start of a document), which are
never evicted, plus the most recent positions. When the memory is full, the
oldest tail positions are dropped in chunks of an eighth of the tail
(amortized O(1) per token), so between ``max_positions - tail/8`` and
``max_positions`` positions are held. ``head_positions=0`` gives a plain
sliding window. Slots ``[0, head)`` hold absolute positions ``[0, head)``;
slots ``[head, n)`` hold consecutive absolute positions starting at
``tail_start``: a continuation never crosses the gap between the two.

Hidden states are stored as 16-bit codes, ``hidden_format`` "bfloat16"
(default) or "float16", plus the exact fp32 inverse norm of each row. bf16
is the default: same size, no overflow clamping (fp16 saturates at 65504),
and widening it back to fp32 in numpy is two integer ops, about 3x faster
than fp16's (table lookup) on the reranking path; its 8-bit mantissa moves a
cosine by ~1e-3, far below what separates candidates. Widening never uses a
torch kernel: on small shapes torch's intra-op threads cost 10-100x more
than they save on busy cores, and the vLLM CPU worker forbids changing
their number.

Footprint per stored position: ``2*hidden + 6*topk + 10`` bytes (16-bit
hidden, int32 ids and fp16 probs of the top-k, int32 token, fp32 inverse
norm, two flags); e.g. 8.2 KB for hidden 4096 and top-4, so a full
8192-position memory takes 67 MB (1.3 KB / 10.6 MB for hidden 576). A
request's memory is dropped on ``remove``.
"""

from __future__ import annotations

import numpy as np
import torch

_FP16_MAX = 65504.0
HIDDEN_FORMATS = ("bfloat16", "float16")

# fp16 -> fp32 by table lookup (2x faster than numpy's astype).
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(
    np.float32
)


def f16_to_f32(a: np.ndarray) -> np.ndarray:
    """fp32 copy of an fp16 array (or of its uint16 bits)."""
    return F16_TO_F32.take(a.view(np.uint16))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """fp32 copy of bf16 values given as uint16 bits."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits of fp32 values, rounded to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))
    return (u >> 16).astype(np.uint16)


def _to_numpy(t: torch.Tensor | np.ndarray, dtype) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(dtype, copy=False)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().astype(dtype, copy=False)


class ContextMemory:
    """One request's memory (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        topk: int,
        max_positions: int,
        head_positions: int = 0,
        initial_capacity: int = 512,
        hidden_format: str = "bfloat16",
    ) -> None:
        if hidden_format not in HIDDEN_FORMATS:
            raise ValueError(f"hidden_format must be one of {HIDDEN_FORMATS}")
        self.hidden_format = hidden_format
        if max_positions < 2:
            raise ValueError("max_positions must be >= 2")
        if not 0 <= head_positions <= max_positions // 2:
            raise ValueError("head_positions must be in [0, max_positions // 2]")
        self.hidden_size = hidden_size
        self.topk = topk
        self.max_positions = max_positions
        self.head = head_positions
        self._chunk = max(1, (max_positions - head_positions) // 8)
        self._initial = max(1, min(initial_capacity, max_positions))
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget everything (keeps the configuration)."""
        self.epoch = getattr(self, "epoch", -1) + 1
        """Bumped by every reset, so derived caches know to rebuild."""
        self.n = 0
        """Slots in use."""
        self.total = 0
        """Length of the request's history seen so far (absolute)."""
        self.tail_start = self.head
        """Absolute position held by slot ``head`` (== head until eviction)."""
        self._alloc(self._initial)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.hidden = np.zeros((capacity, self.hidden_size), dtype=np.uint16)
        """16-bit codes (``hidden_format``); read with ``hidden_f32``."""
        self.inv_norm = np.zeros(capacity, dtype=np.float32)
        """1/||hidden|| in fp32 (0 where missing or zero)."""
        self.has_hidden = np.zeros(capacity, dtype=bool)
        self.topk_ids = np.full((capacity, self.topk), -1, dtype=np.int32)
        self.topk_probs = np.zeros((capacity, self.topk), dtype=np.float16)
        self.has_topk = np.zeros(capacity, dtype=bool)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.tokens, self.hidden, self.inv_norm, self.has_hidden,
                self.topk_ids, self.topk_probs, self.has_topk)

    def _ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = min(self.max_positions, max(needed + needed // 4, 2 * self.capacity))
        old = self._arrays()
        self._alloc(new_cap)
        for dst, src in zip(self._arrays(), old):
            dst[: self.n] = src[: self.n]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays())

    @property
    def evicted(self) -> bool:
        """True once tail positions were dropped (slots no longer == positions)."""
        return self.tail_start != self.head

    # ---------------------------------------------------------------- writing

    def update(
        self,
        token_ids: np.ndarray,
        verified_pos: int,
        layer_hidden: torch.Tensor | np.ndarray | None = None,
        topk_ids: torch.Tensor | np.ndarray | None = None,
        topk_probs: torch.Tensor | np.ndarray | None = None,
        topk_offset: int = 0,
    ) -> None:
        """Sync with a ``StepRequest``: append new tokens of ``token_ids`` and
        store per-position rows. Row ``r`` of ``layer_hidden`` belongs to
        absolute position ``verified_pos + r``, of the top-k to
        ``verified_pos + topk_offset + r`` (a prompt chunk's top-k covers
        only its last rows). A history shorter than what was seen resets
        the memory."""
        length = int(len(token_ids))
        if length < self.total:
            self.reset()
        if length > self.total:
            self._append(np.asarray(token_ids[self.total : length]))
            self.total = length
        if layer_hidden is not None and len(layer_hidden):
            self._write_hidden(verified_pos, layer_hidden)
        if topk_ids is not None and len(topk_ids):
            self._write_topk(verified_pos + topk_offset, topk_ids, topk_probs)

    def _put(self, toks: np.ndarray) -> None:
        m = len(toks)
        if not m:
            return
        self._ensure(self.n + m)
        s = slice(self.n, self.n + m)
        self.tokens[s] = toks
        self.has_hidden[s] = False
        self.inv_norm[s] = 0.0
        self.has_topk[s] = False
        self.n += m

    def _append(self, toks: np.ndarray) -> None:
        head = self.head
        if self.n < head:  # the head fills first and is never evicted
            k = min(head - self.n, len(toks))
            self._put(toks[:k])
            toks = toks[k:]
        overflow = self.n + len(toks) - self.max_positions
        if overflow > 0:
            old_tail = self.n - head
            drop_old = min(old_tail, max(overflow, self._chunk))
            skip_new = max(0, overflow - drop_old)
            if drop_old:
                keep = old_tail - drop_old
                for a in self._arrays():
                    a[head : head + keep] = a[head + drop_old : self.n]
                self.n = head + keep
            self.tail_start += drop_old + skip_new
            toks = toks[skip_new:]
        self._put(toks)

    def _slot(self, pos: int) -> int:
        """``slot_of`` in plain Python (hot path)."""
        if pos < 0:
            return -1
        if pos < self.head:
            s = pos
        elif pos >= self.tail_start:
            s = pos - self.tail_start + self.head
        else:
            return -1
        return s if s < self.n else -1

    def _row_slots(self, verified_pos: int, rows: int):
        """(row selector, slot selector) of the rows whose positions are
        stored: slices in the usual case of one contiguous run of slots,
        index arrays otherwise; None if no row is stored."""
        first, last = self._slot(verified_pos), self._slot(verified_pos + rows - 1)
        if first >= 0 and last - first == rows - 1:
            return slice(None), slice(first, last + 1)
        pos = np.arange(verified_pos, verified_pos + rows, dtype=np.int64)
        slots = self.slots_of(pos)
        keep = np.flatnonzero(slots >= 0)
        return (keep, slots[keep]) if len(keep) else None

    def _write_hidden(self, verified_pos: int, h) -> None:
        sel = self._row_slots(verified_pos, len(h))
        if sel is None:
            return
        keep, slots = sel
        bf16 = self.hidden_format == "bfloat16"
        if isinstance(h, torch.Tensor) and h.device.type != "cpu":
            # Reduce and encode on the device, then move 16-bit rows.
            h = h.detach()
            if not isinstance(keep, slice):
                h = h[torch.from_numpy(keep).to(h.device)]
            hf = h.float()
            norms = _to_numpy(torch.linalg.vector_norm(hf, dim=-1), np.float32)
            enc = hf.to(torch.bfloat16) if bf16 else hf.clamp(-_FP16_MAX, _FP16_MAX).half()
            rows = enc.view(torch.int16).cpu().numpy().view(np.uint16)
        else:
            # numpy on CPU: no intra-op thread pool to wake up.
            hf = _to_numpy(h, np.float32)[keep]
            norms = np.sqrt(np.einsum("ij,ij->i", hf, hf))
            if bf16:
                rows = f32_to_bf16(hf)
            else:
                rows = np.clip(hf, -_FP16_MAX, _FP16_MAX).astype(np.float16).view(np.uint16)
        inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
        self.hidden[slots] = rows
        self.inv_norm[slots] = inv
        self.has_hidden[slots] = True

    def _write_topk(self, verified_pos: int, ids, probs) -> None:
        sel = self._row_slots(verified_pos, len(ids))
        if sel is None or self.topk == 0:
            return
        keep, slots = sel
        ids = _to_numpy(ids, np.int32)[keep][:, : self.topk]
        k = ids.shape[1]
        if probs is None:  # rank order only
            p = np.linspace(1.0, 0.5, k, dtype=np.float16)
        else:
            p = _to_numpy(probs, np.float16)[keep][:, : self.topk]
        self.topk_ids[slots, :k] = ids
        self.topk_probs[slots, :k] = p
        if k < self.topk:
            self.topk_ids[slots, k:] = -1
            self.topk_probs[slots, k:] = 0
        self.has_topk[slots] = True

    # ---------------------------------------------------------------- reading

    def slots_of(self, pos: np.ndarray) -> np.ndarray:
        """Slot of each absolute position, -1 where not stored."""
        pos = np.asarray(pos, dtype=np.int64)
        slots = np.where(pos < self.head, pos, pos - self.tail_start + self.head)
        ok = (pos >= 0) & ((pos < self.head) | (pos >= self.tail_start)) & (slots < self.n)
        return np.where(ok, slots, -1)

    def slot_of(self, pos: int) -> int:
        return int(self.slots_of(np.array([pos]))[0])

    def positions_of(self, slots: np.ndarray) -> np.ndarray:
        """Absolute position of each slot."""
        slots = np.asarray(slots, dtype=np.int64)
        return np.where(slots < self.head, slots, slots - self.head + self.tail_start)

    def has_prev(self, slots: np.ndarray) -> np.ndarray:
        """Slot ``s - 1`` holds the position right before slot ``s``."""
        slots = np.asarray(slots, dtype=np.int64)
        return (slots >= 1) & ~((slots == self.head) & self.evicted)

    def has_next(self, slots: np.ndarray) -> np.ndarray:
        """Slot ``s + 1`` exists and holds the position right after slot ``s``."""
        slots = np.asarray(slots, dtype=np.int64)
        return (slots + 1 < self.n) & ~((slots == self.head - 1) & self.evicted)

    def run_end(self, slot: int) -> int:
        """One past the last slot contiguous with ``slot``."""
        if slot < self.head and self.evicted:
            return self.head
        return self.n

    def hidden_f32(self, slots) -> np.ndarray:
        """fp32 copy of the stored layer outputs at ``slots`` (an index or
        an index array)."""
        codes = self.hidden[slots]
        return bf16_to_f32(codes) if self.hidden_format == "bfloat16" else f16_to_f32(codes)

    def continuation(self, slot: int, length: int) -> np.ndarray:
        """Up to ``length`` stored tokens right after ``slot`` (never across
        the head/tail gap)."""
        end = min(self.run_end(slot), slot + 1 + max(0, length))
        return self.tokens[slot + 1 : end]


class ContextMemoryStore:
    """The memories of all live requests, keyed by request id."""

    def __init__(self, hidden_size: int, topk: int, max_positions: int,
                 head_positions: int = 0, initial_capacity: int = 512,
                 hidden_format: str = "bfloat16") -> None:
        self._args = (hidden_size, topk, max_positions, head_positions, initial_capacity,
                      hidden_format)
        # Fail on bad sizes now rather than at the first request.
        ContextMemory(*self._args[:4], initial_capacity=1, hidden_format=hidden_format)
        self._mems: dict[str, ContextMemory] = {}

    def get(self, req_id: str) -> ContextMemory:
        mem = self._mems.get(req_id)
        if mem is None:
            mem = self._mems[req_id] = ContextMemory(*self._args)
        return mem

    def remove(self, req_id: str) -> None:
        self._mems.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._mems

    def __len__(self) -> int:
        return len(self._mems)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._mems.values())
