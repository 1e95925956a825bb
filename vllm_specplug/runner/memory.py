"""What a specplug step and its per-request state can take, in bytes.

Pure arithmetic (no torch, no vLLM), shared by the profile-run reservation
(``runner/reserve.py``), the start-up log line and the CPU check.

A tree step has ``rows = requests x (nodes + 1)`` logits rows (never more
than the step's scheduled tokens). The plugin's per-row work over the
vocabulary (sampled rows' probabilities, top-k, entropies, the relaxed
rule's log-probabilities) runs in chunks of :func:`chunk_rows` rows, so its
temporaries are bounded by ``CHUNK_BYTES`` whatever the batch. What cannot
be chunked is vLLM's: the logits themselves, the path rows handed to its
rejection sampler (``logits[path]`` and the dense draft distribution of the
sampled requests) and the sampler's own temporaries over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20

CHUNK_BYTES = 32 * MIB
"""One float32 ``[rows, vocab]`` temporary of the plugin's per-row work:
rows are processed this many bytes at a time (at least one row)."""

SAMPLED_BYTES_PER_ELEMENT = 32
"""Estimate of what probabilities under top-k/top-p take per element while
computed (a float32 copy, vLLM's sort values and int64 indices, a mask, the
softmax): 4 + 4 + 8 + 1 + 4 = 21 bytes, rounded up. Used for the sampled
rows' chunks and for vLLM's rejection sampler over the path rows."""

ENTROPY_BYTES_PER_ELEMENT = 16
"""Entropy's float32 temporaries per element (the row copy, ``z``, ``e``,
``e * z``), next to the row's copy in the logits' dtype."""

HOST_FRACTION = 1.0
"""On CPU the KV cache is sized from ``VLLM_CPU_KVCACHE_SPACE`` (or
vLLM's memory fraction), not by profiling: start-up refuses when the
plugin's own share of the reservation (``Reservation.own``, already a
worst case: every request at its caps with a full tree) exceeds this share
of the host memory available beside the KV cache. All of it: what is
available moves with other processes, and a margin below it would refuse
engines that fit on a busy host."""

VLLM_ITEMS = ("logits", "rejection sampler")
"""Items vLLM's own chain speculative decoding at the same
``num_speculative_tokens`` allocates too (as many logits rows; a path is
never longer than a chain): reserved on a GPU, since vLLM's profile run
does not cover them, but not counted against the host on CPU, where vLLM
itself would not refuse them."""


def chunk_rows(vocab: int, budget: int | None = None) -> int:
    """Rows of a float32 ``[rows, vocab]`` chunk that fit ``budget`` bytes
    (default ``CHUNK_BYTES``)."""
    return max(1, (budget or CHUNK_BYTES) // (4 * max(1, vocab)))


def tree_rows(max_num_seqs: int, num_speculative_tokens: int,
              max_num_batched_tokens: int) -> int:
    """Logits rows of the largest tree step: every request with a full tree
    (root + ``num_speculative_tokens`` nodes), within the step's tokens."""
    return min(max_num_seqs * (num_speculative_tokens + 1), max_num_batched_tokens)


@dataclass(frozen=True)
class StepShape:
    """The largest step the engine can schedule."""

    max_num_seqs: int
    num_speculative_tokens: int
    max_num_batched_tokens: int
    vocab: int
    logits_bytes: int
    """Element size of the target's logits (its dtype)."""

    @property
    def rows(self) -> int:
        return tree_rows(self.max_num_seqs, self.num_speculative_tokens,
                         self.max_num_batched_tokens)

    @property
    def chunk(self) -> int:
        return min(self.rows, chunk_rows(self.vocab))


def step_items(s: StepShape) -> dict[str, int]:
    """Bytes of a worst-case tree step, by what holds them. A real step
    needs at most their sum: the per-row chunks and the rejection
    sampler's temporaries are not alive at once, but are counted so."""
    cells, chunk = s.rows * s.vocab, s.chunk * s.vocab
    per_chunk = max(SAMPLED_BYTES_PER_ELEMENT, ENTROPY_BYTES_PER_ELEMENT + s.logits_bytes)
    return {
        "logits": cells * s.logits_bytes,
        "path rows": cells * (s.logits_bytes + 4),  # logits[path], draft probs
        "rejection sampler": cells * SAMPLED_BYTES_PER_ELEMENT,
        "row chunks": chunk * per_chunk,
    }


def head_state_items(max_num_seqs: int, row_bytes: int, request_tokens: int,
                     max_kv_bytes: int | None, store_bytes: int,
                     held_rows: int, held_row_bytes: int,
                     max_held_bytes: int | None = None) -> dict[str, int]:
    """A drafting head's per-request state at its caps: every request's
    K/V (``request_tokens`` positions of ``row_bytes`` each, or
    ``max_kv_bytes`` for them all when that is smaller), the prefix store,
    and the verified rows gated requests hold (``held_rows`` each, or
    ``max_held_bytes`` for them all when that is smaller)."""
    kv = max_num_seqs * request_tokens * row_bytes
    if max_kv_bytes is not None:
        kv = min(kv, max_kv_bytes)
    held = max_num_seqs * held_rows * held_row_bytes
    if max_held_bytes is not None:
        held = min(held, max_held_bytes)
    return {"head K/V": kv, "head prefix store": store_bytes, "held rows": held}


def doubled_tokens(max_model_len: int, initial: int = 256) -> int:
    """Positions a state that doubles from ``initial`` can reach when it
    must hold ``max_model_len`` (the last doubling may overshoot)."""
    cap = initial
    while cap < max_model_len:
        cap *= 2
    return cap


@dataclass(frozen=True)
class Reservation:
    """Bytes the plugin may take beyond vLLM's own profile, by item."""

    items: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.items.values())

    @property
    def own(self) -> int:
        """What only the plugin allocates (``total`` less ``VLLM_ITEMS``)."""
        return sum(v for k, v in self.items.items() if k not in VLLM_ITEMS)

    def line(self, measured: int | None = None) -> str:
        """The start-up log line."""
        parts = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in self.items.items() if v)
        head = (f"specplug reserves {self.total / MIB:.1f} MiB for drafting "
                f"({self.own / MIB:.1f} MiB beyond vLLM's chain verification)")
        if measured is not None:
            head += f" (a worst-case step measured {measured / MIB:.1f} MiB)"
        return f"{head}: {parts or 'nothing'}"


def host_shortfall(reservation: int, available: int, kv_cache: int,
                   fraction: float = HOST_FRACTION) -> str | None:
    """Why a CPU engine cannot hold the reservation beside its KV cache
    (one line), or None when it can."""
    room = max(0, available - kv_cache)
    if reservation <= fraction * room:
        return None
    share = "" if fraction >= 1 else f"{fraction:.0%} of "
    return (f"specplug needs {reservation / MIB:.0f} MiB of host memory for drafting, "
            f"more than {share}the {room / MIB:.0f} MiB available beside the KV cache: "
            "lower max_num_seqs, num_speculative_tokens, the drafting head's caps or "
            "the KV cache (VLLM_CPU_KVCACHE_SPACE)")
