"""vLLM's CPU worker, building the specplug model runner."""

from __future__ import annotations

import psutil
import vllm.v1.worker.cpu_worker as _cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_specplug.runner import reserve
from vllm_specplug.runner.runner import SpecplugRunnerMixin


class SpecplugCPUModelRunner(SpecplugRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._sp_init()


class SpecplugCPUWorker(_cpu_worker.CPUWorker):
    def init_device(self) -> None:
        # CPUWorker.init_device builds CPUModelRunner inline; swap the name it
        # looks up for the duration of the call.
        original = _cpu_worker.CPUModelRunner
        _cpu_worker.CPUModelRunner = SpecplugCPUModelRunner
        try:
            super().init_device()
        finally:
            _cpu_worker.CPUModelRunner = original

    def determine_available_memory(self) -> int:
        # vLLM sizes the CPU KV cache from VLLM_CPU_KVCACHE_SPACE (or its
        # memory fraction), not from a profile run: the plugin's worst case
        # must fit in what the host has left beside it (runner/reserve.py)
        kv_cache_bytes = super().determine_available_memory()
        reserve.check_host(self.model_runner, kv_cache_bytes,
                           psutil.virtual_memory().available)
        return kv_cache_bytes

    def specplug_stats(self) -> dict:
        return self.model_runner.specplug_stats()

    def specplug_reset_budget(self) -> bool:
        return self.model_runner.specplug_reset_budget()
