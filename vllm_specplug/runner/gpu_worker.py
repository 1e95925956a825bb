"""vLLM's GPU worker (V1 model runner), building the specplug model runner."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_specplug.runner.runner import SpecplugRunnerMixin


class SpecplugGPUModelRunner(SpecplugRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._sp_init()


class SpecplugGPUWorker(Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        return SpecplugGPUModelRunner(self.vllm_config, self.device)

    def specplug_stats(self) -> dict:
        return self.model_runner.specplug_stats()

    def specplug_reset_budget(self) -> bool:
        return self.model_runner.specplug_reset_budget()
