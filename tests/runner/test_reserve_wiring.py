"""runner/reserve.py's wiring: the head caps it reads, the order of the
GPU profile run (state held while vLLM profiles, the worst-case step
inside the window, everything freed after), and the CPU start-up check."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from types import SimpleNamespace

import pytest
import torch

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.runner import reserve
from vllm_specplug.runner.memory import MIB, Reservation
from vllm_specplug.runner.runner import SpecplugRunnerMixin


def _head(**caps):
    rt = SimpleNamespace(nkv=2, hd=4, dtype=torch.float32, row_bytes=64, store_blocks=0,
                         store_bytes_max=1000, max_request_tokens=None, max_kv_bytes=None)
    for k, v in caps.items():
        setattr(rt, k, v)
    return SimpleNamespace(runtime=rt, aux_layers=(1, 2, 3), max_held_rows=10,
                           max_held_bytes=None)


def test_state_items_read_the_head_caps():
    # 4 requests; max_model_len 300 -> a doubling state reaches 512 positions
    assert reserve.state_items(_head(), 4, 300, 8, torch.float32) == {
        "head K/V": 4 * 512 * 64, "head prefix store": 1000,
        "held rows": 4 * 10 * (3 * 8 * 4)}  # 3 aux layers x hidden 8 x float32
    assert reserve.state_items(_head(max_request_tokens=100), 4, 300, 8,
                               torch.float32)["head K/V"] == 4 * 100 * 64
    assert reserve.state_items(_head(max_kv_bytes=5000), 4, 300, 8,
                               torch.float32)["head K/V"] == 5000
    prop = _head()
    prop.max_held_bytes = 77
    assert reserve.state_items(prop, 4, 300, 8, torch.bfloat16)["held rows"] == 77
    assert reserve.state_items(SimpleNamespace(), 4, 300, 8, torch.float32) == {}


class _VllmRunner:
    def profile_run(self, *args, **kwargs):
        self.calls.append("vllm profile")


class _Runner(SpecplugRunnerMixin, _VllmRunner):
    def __init__(self, device_type: str):
        self.calls: list[str] = []
        self.device = SimpleNamespace(type=device_type)
        self.model = SimpleNamespace(compute_logits=None)
        self.model_config = SimpleNamespace(get_hidden_size=lambda: 8)
        self.dtype, self.rejection_sampler = torch.float32, None


class _Held:
    def __init__(self, calls):
        self.calls = calls

    def __del__(self):
        self.calls.append("state freed")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_profile_run_order(monkeypatch, device):
    runner = _Runner(device)
    res = Reservation({"logits": MIB, "head K/V": 2 * MIB})
    monkeypatch.setattr(reserve, "reservation_for", lambda r: (res, {"head K/V": 2 * MIB}))
    monkeypatch.setattr(reserve, "step_shape", lambda r: "shape")

    def hold(items, dev):
        runner.calls.append(f"hold {sorted(items)}")
        return [_Held(runner.calls)]

    monkeypatch.setattr(reserve, "hold", hold)
    monkeypatch.setattr(reserve, "worst_case_step",
                        lambda shape, *a, **k: runner.calls.append(f"step {shape}"))
    runner.profile_run()
    if device == "cuda":
        assert runner.calls == ["hold ['head K/V']", "vllm profile", "step shape",
                                "state freed"]
    else:  # vLLM's CPU KV cache is not sized by profiling: nothing added
        assert runner.calls == ["vllm profile"]


def test_check_host(monkeypatch, caplog):
    res = Reservation({"logits": 10**6 * MIB, "row chunks": 100 * MIB})
    monkeypatch.setattr(reserve, "reservation_for", lambda r: (res, {}))
    # vLLM's own items (the logits) do not count against the host
    assert reserve.check_host(None, kv_cache_bytes=1000 * MIB, available=1200 * MIB) is res
    # 100 MiB > the 90 MiB left beside the KV cache
    with pytest.raises(SpecplugConfigError, match="VLLM_CPU_KVCACHE_SPACE"):
        reserve.check_host(None, kv_cache_bytes=1000 * MIB, available=1090 * MIB)
