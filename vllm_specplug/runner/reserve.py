"""The plugin's memory inside vLLM's budget (vLLM 0.32).

On a GPU vLLM sizes the KV cache from the peak memory of its profile run
(``Worker.determine_available_memory``), which knows nothing of tree steps:
``SpecplugRunnerMixin.profile_run`` holds the drafting head's per-request
state at its caps while vLLM profiles, then runs :func:`worst_case_step`,
so the KV cache leaves room for both. On CPU the KV cache is sized from
``VLLM_CPU_KVCACHE_SPACE`` (or vLLM's memory fraction), not by profiling:
:func:`check_host` logs the reservation and refuses to start when it does
not fit beside the KV cache. The arithmetic is ``runner/memory.py``'s.
"""

from __future__ import annotations

import torch

from vllm.logger import init_logger

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.runner.logit_rows import entropy, log_softmax_topk, sampled_probs, topk_probs
from vllm_specplug.runner.memory import (
    Reservation,
    StepShape,
    doubled_tokens,
    head_state_items,
    host_shortfall,
    step_items,
)

logger = init_logger("vllm.specplug.reserve")

DUMMY_TOPK = 8
"""Top-k width of the worst-case step (what tree-drafting methods ask)."""


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def step_shape(runner) -> StepShape:
    """The largest tree step this engine can schedule."""
    return StepShape(
        max_num_seqs=runner.max_num_reqs,
        num_speculative_tokens=runner.speculative_config.num_speculative_tokens,
        max_num_batched_tokens=runner.scheduler_config.max_num_batched_tokens,
        vocab=runner.model_config.get_vocab_size(),
        logits_bytes=_element_size(runner.dtype),
    )


def state_items(proposer, max_num_seqs: int, max_model_len: int,
                hidden_size: int, target_dtype: torch.dtype) -> dict[str, int]:
    """A head method's per-request state at its caps (``Eagle3Runtime``'s
    ``max_request_tokens`` / ``max_kv_bytes`` / prefix store, the method's
    ``max_held_rows`` / ``max_held_bytes``); without a per-request cap a
    state can grow to hold the whole context (doubling). Methods without a
    head: nothing."""
    rt = getattr(proposer, "runtime", None)
    if rt is None or not hasattr(rt, "nkv"):
        return {}
    row_bytes = getattr(rt, "row_bytes", 2 * rt.nkv * rt.hd * _element_size(rt.dtype))
    tokens = doubled_tokens(max_model_len)
    limit = getattr(rt, "max_request_tokens", None)
    if limit is not None:
        tokens = min(tokens, limit)
    store = getattr(rt, "store_bytes_max", None)
    if store is None:
        store = rt.store_blocks * 16 * row_bytes
    aux = len(getattr(proposer, "aux_layers", ()))
    return head_state_items(
        max_num_seqs, row_bytes, tokens, getattr(rt, "max_kv_bytes", None), store,
        getattr(proposer, "max_held_rows", 0) or 0,
        aux * hidden_size * _element_size(target_dtype),
        getattr(proposer, "max_held_bytes", None))


def reservation_for(runner) -> tuple[Reservation, dict[str, int]]:
    """The whole reservation, and its per-request state part."""
    state = state_items(runner._sp_proposer, runner.max_num_reqs, runner.max_model_len,
                        runner.model_config.get_hidden_size(), runner.dtype)
    return Reservation({**step_items(step_shape(runner)), **state}), state


def hold(items: dict[str, int], device) -> list[torch.Tensor]:
    """Buffers the size of each item, allocated now (freed with the list)."""
    try:
        return [torch.empty(n, dtype=torch.uint8, device=device)
                for n in items.values() if n > 0]
    except torch.OutOfMemoryError:
        total = sum(items.values()) / 2**20
        raise SpecplugConfigError(
            f"specplug cannot reserve {total:.0f} MiB for the drafting head's "
            "per-request state: lower max_num_seqs or max_model_len, or cap the "
            "head's K/V (max_request_tokens / max_kv_bytes)") from None


def dummy_sampling_metadata(n: int, vocab: int, device):
    """vLLM's own profile-run metadata (``GPUModelRunner._dummy_sampler_run``):
    random sampling under top-k and top-p, the costliest path."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(v):
        return torch.full((n,), v, device=device)

    return SamplingMetadata(
        temperature=full(0.5), all_greedy=False, all_random=False, top_p=full(0.9),
        top_k=full(vocab - 1), generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=full(0.1),
        presence_penalties=full(0.1), repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(n)], spec_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


@torch.inference_mode()
def worst_case_step(shape: StepShape, compute_logits, hidden_size: int, dtype,
                    rejection_sampler, device, max_rows: int | None = None) -> None:
    """Allocate what the largest tree step allocates after the forward pass:
    the logits of every row, one chunk of sampled rows' probabilities, the
    path rows through vLLM's rejection sampler with a dense draft
    distribution, and the top-k / entropy / relaxed-rule chunks over every
    row. Inputs are random; results are dropped."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    rows = shape.rows
    # as many full trees as the step's rows hold: the longest paths
    per_req = min(shape.num_speculative_tokens + 1, rows)
    n = max(1, rows // per_req)
    logits = compute_logits(torch.rand(rows, hidden_size, device=device, dtype=dtype))
    sm = dummy_sampling_metadata(n, shape.vocab, device)
    everything = torch.arange(n * per_req, device=device)
    chunk = max_rows or shape.chunk
    group = max(1, chunk // per_req)  # whole requests per chunk
    counts = torch.zeros(n, dtype=torch.long)
    counts[:group] = per_req
    sampled_probs(logits, everything[: group * per_req], counts.cumsum(0).to(device), sm)
    if per_req > 1:
        meta = SpecDecodeMetadata.make_dummy([[0] * (per_req - 1)] * n, device)
        draft_probs = torch.zeros(n * (per_req - 1), shape.vocab, device=device)
        path_logits = logits.index_select(0, everything)
        rejection_sampler(meta, draft_probs, path_logits, sm)
        del draft_probs, path_logits
    topk_probs(logits, DUMMY_TOPK, everything, chunk)
    entropy(logits, everything, chunk)
    log_softmax_topk(logits, DUMMY_TOPK, everything, chunk)


def check_host(runner, kv_cache_bytes: int, available: int) -> Reservation:
    """CPU: log the reservation; refuse (one line) when the plugin's own
    share does not fit in ``memory.HOST_FRACTION`` of the host memory left
    beside the KV cache."""
    res, _ = reservation_for(runner)
    logger.info("%s", res.line())
    why = host_shortfall(res.own, available, kv_cache_bytes)
    if why is not None:
        raise SpecplugConfigError(why)
    return res
