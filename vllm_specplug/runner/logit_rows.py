"""Per-row work over the vocabulary, a bounded chunk of rows at a time.

A tree step has ``requests x (nodes + 1)`` logits rows; every float32
``[rows, vocab]`` temporary of that size (2.6 GB at 256 requests, 16 nodes
and a 150k vocabulary) would sit outside vLLM's memory budget. Each function
here selects and processes at most ``max_rows`` rows at a time
(``runner/memory.chunk_rows``: ``CHUNK_BYTES`` per float32 temporary), so
the peak no longer grows with the batch. Rows are independent: a row's
result is the one the whole-tensor computation gives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_specplug.engine.transfer import to_device
from vllm_specplug.engine.verify import ChildDraws, child_draws_chunked
from vllm_specplug.runner.memory import chunk_rows


def _chunks(logits: torch.Tensor, rows: torch.Tensor | None, max_rows: int | None):
    """``logits`` rows (all, or those indexed by ``rows``), ``max_rows`` at
    a time (default: ``chunk_rows`` of the vocabulary)."""
    n = logits.shape[0] if rows is None else rows.shape[0]
    step = max_rows or chunk_rows(logits.shape[-1])
    for s in range(0, n, step):
        yield logits[s:s + step] if rows is None else logits.index_select(0, rows[s:s + step])


def _per_chunk(fn: Callable, logits, rows, max_rows):
    outs = [fn(c) for c in _chunks(logits, rows, max_rows)]
    if not outs:  # no rows: the shapes an empty batch gives
        return fn(logits[:0])
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def _entropy_dense(logits: torch.Tensor) -> torch.Tensor:
    # H = log(sum e) - sum(e * z) / sum(e), e = exp(z), z = logits - max:
    # one exp pass and no log over the vocabulary (4x faster than
    # entr(softmax) on a 2-core CPU); z clamped so masked entries give
    # 0 * -1e30 = 0, not nan.
    lg = logits.float()
    z = (lg - lg.amax(-1, keepdim=True)).clamp(min=-1e30)
    e = z.exp()
    s = e.sum(-1)
    return s.log() - (e * z).sum(-1) / s


def entropy(logits: torch.Tensor, rows: torch.Tensor | None = None,
            max_rows: int | None = None) -> torch.Tensor:
    """Shannon entropy (nats) of each row's softmax, in float32;
    zero-probability (masked, ``-inf``) entries add 0. ``rows``: the
    logits rows to take (default all)."""
    return _per_chunk(_entropy_dense, logits, rows, max_rows)


def topk_probs(logits: torch.Tensor, k: int, rows: torch.Tensor | None = None,
               max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` softmax probabilities and ids of each row, in float32: the
    softmax of the top-k only (no second ``[rows, vocab]`` tensor)."""

    def one(chunk):
        lg = chunk.float()
        top, ids = lg.topk(min(k, lg.shape[-1]), dim=-1)
        return torch.exp(top - torch.logsumexp(lg, -1, keepdim=True)), ids

    return _per_chunk(one, logits, rows, max_rows)


def topk_ids(logits: torch.Tensor, k: int, rows: torch.Tensor | None = None,
             max_rows: int | None = None) -> torch.Tensor:
    """The ids of ``topk_probs``, without the probabilities: the softmax
    keeps the logits' order, so no pass over the vocabulary beyond the
    top-k (taken in float32 as there, so ties order alike)."""
    return _per_chunk(lambda chunk: chunk.float().topk(min(k, chunk.shape[-1]), dim=-1)[1],
                      logits, rows, max_rows)


def log_softmax_topk(logits: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                     max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probabilities (float32) and ids of each row."""

    def one(chunk):
        logp = torch.log_softmax(chunk.float(), dim=-1)
        return logp.topk(min(k, logp.shape[-1]), dim=-1)

    return tuple(_per_chunk(one, logits, rows, max_rows))


def sampled_probs(logits: torch.Tensor, rows: torch.Tensor, cu_rows: torch.Tensor,
                  sampling_metadata) -> torch.Tensor:
    """Probabilities of the ``rows`` of some requests under their own
    temperature/top-k/top-p; ``cu_rows`` ``[requests]``: cumulative rows per
    batch request, zero for those not taken (vLLM's per-request expansion).
    Called per chunk of whole requests (``memory.request_chunks``)."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    lg = logits.index_select(0, rows).float()
    return torch.softmax(apply_sampling_constraints(lg, cu_rows, sampling_metadata), dim=-1)


def sampled_child_probs(logits: torch.Tensor, trees, drafts: list[list[int]],
                        sampled: list[int], num_drafts, row_base, sampling_metadata,
                        max_rows: int | None = None) -> ChildDraws:
    """``engine/verify.child_probs`` for the ``sampled`` tree requests,
    their probabilities made a chunk of whole requests at a time (request
    i: ``num_drafts[i] + 1`` rows from logits row ``row_base[i]``), left on
    the device (``ChildDraws.on_host`` reads them)."""
    counts = {i: int(num_drafts[i]) + 1 for i in sampled}

    def probs_of(reqs: list[int]) -> torch.Tensor:
        per_request = np.zeros(len(num_drafts), dtype=np.int64)
        for i in reqs:
            per_request[i] = counts[i]
        sel = np.concatenate([int(row_base[i]) + np.arange(counts[i]) for i in reqs])
        cu = to_device(np.cumsum(per_request), torch.long, logits.device)
        idx = to_device(sel, torch.long, logits.device)
        return sampled_probs(logits, idx, cu, sampling_metadata)

    return child_draws_chunked(trees, drafts, sampled, counts, probs_of,
                               sampling_metadata.generators,
                               max_rows or chunk_rows(logits.shape[-1]))
