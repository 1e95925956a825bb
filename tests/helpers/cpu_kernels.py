"""The CPU worker's start-up kernel replacements, for tests that sample
outside an engine."""

from __future__ import annotations


def cpu_kernels() -> None:
    """What the CPU worker does at start-up: C++ stand-ins for vLLM's
    Triton kernels (the per-request expansion among them)."""
    from vllm.platforms import current_platform

    from vllm_specplug.runner.runner import apply_vllm_cpu_fixes

    if hasattr(current_platform, "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    apply_vllm_cpu_fixes()
