"""The kernels' dispatchers: interpreter kernels take CPU tensors only where
asked (the kernel tests and the check kit), so an engine on CPU in a process
whose kernels were decorated for the interpreter still runs the torch path."""

from __future__ import annotations

import torch

from vllm_specplug.kernels import INTERPRET_ON_CPU, kernel_is_interpreted, use_triton


def test_interpreter_kernels_take_cpu_tensors_only_where_asked(monkeypatch):
    from vllm_specplug.kernels.kv_move import _kv_gather_kernel

    assert kernel_is_interpreted(_kv_gather_kernel)  # this directory's conftest
    cpu = torch.zeros(4)
    assert use_triton(_kv_gather_kernel, cpu)  # set for these tests
    monkeypatch.delenv(INTERPRET_ON_CPU)
    assert not use_triton(_kv_gather_kernel, cpu)
