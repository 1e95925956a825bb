"""vLLM 0.32 CPU sampling pieces replaced: one breaks lossless sampling,
one makes every sampled verification step pay for noise it never reads."""

from __future__ import annotations

import torch


def _expand_kernel_cpu(output, input_val, cu_num_tokens, replace_from,
                       replace_to, MAX_NUM_TOKENS=None):
    """Per-request value -> per-token value, as vLLM's Triton ``expand_kernel``.

    vLLM 0.32's CPU stand-in casts ``output`` to int64 into a temporary and
    never copies back, so the expanded temperatures (and top-k/top-p) are
    garbage and every temperature > 0 verification on CPU samples from the
    wrong distribution. This one writes in place.
    """
    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from,
                       torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def _exponential_inverse_rows(rows: int, vocab: int, dtype, generators: dict,
                              request_of_row: list[int]) -> torch.Tensor:
    """``1 / E`` for ``E`` ~ Exp(1) iid, ``[rows, vocab]``: ``E = -log U``
    with ``U`` uniform on [0, 1) (a ``U`` of 0 gives 0, a token that cannot
    win). Row ``r`` draws from its request's generator where it has one
    (``request_of_row[r]``), else from the global one, as vLLM's rows do.
    On CPU torch's ``exponential_`` costs about 1.2 ms per 49k-token row,
    four times ``rand`` + ``log``."""
    u = torch.rand((rows, vocab), dtype=dtype)
    for r, req in enumerate(request_of_row):
        gen = generators.get(req)
        if gen is not None:
            u[r].uniform_(generator=gen)
    return u.log_().reciprocal_().neg_()


def _sample_recovered_tokens_cpu(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                 draft_token_ids, draft_probs, target_probs,
                                 sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM's ``sample_recovered_tokens`` (the token drawn from the residual
    distribution where a draft token is rejected) with the same
    distribution at a fraction of its CPU cost: vLLM draws an
    exponential noise row for every request of the batch, drafts or not
    (10 ms at 8 requests over a 49k vocabulary), where only the requests
    with drafts read one; here only those draw, and by ``rand`` + ``log``.
    The argmax over ``residual / E`` is vLLM's own kernel."""
    from vllm.v1.sample.rejection_sampler import _sample_recovered_tokens

    vocab = target_probs.shape[-1]
    dtype = torch.float64 if use_fp64_gumbel else torch.float32
    drafting = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    # rows of requests without drafts are not read (zeros all the same)
    inv_q = torch.zeros((len(num_draft_tokens), vocab), dtype=dtype, device=device)
    if drafting:
        noise = _exponential_inverse_rows(len(drafting), vocab, dtype,
                                          sampling_metadata.generators, drafting)
        inv_q.index_copy_(0, torch.tensor(drafting, device=device), noise.to(device))
    recovered = torch.empty_like(draft_token_ids)
    _sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                             target_probs, inv_q, max_spec_len=max_spec_len)
    return recovered


def apply_vllm_cpu_fixes() -> None:
    """Replace vLLM 0.32 CPU pieces: the per-request expansion that breaks
    lossless sampling (``_expand_kernel_cpu``) and the recovered-token
    sampling that draws noise for every request (``_sample_recovered_tokens_cpu``).
    Process-wide once a specplug engine starts; both keep vLLM's output
    distribution. Idempotent."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel_cpu})
    rejection_sampler.sample_recovered_tokens = _sample_recovered_tokens_cpu
