"""vLLM 0.32 CPU kernels replaced because they break lossless sampling."""

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


def apply_vllm_cpu_fixes() -> None:
    """Replace vLLM 0.32 CPU kernels that break lossless sampling (see
    ``_expand_kernel_cpu``). Idempotent."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels

    if not current_platform.is_cpu():
        return
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel_cpu})
