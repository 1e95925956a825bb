"""`plain`: the plugin's engine decoding without speculation.

It drafts nothing, ever: every step is a plain decoding step, run through
the plugin's runner and, on CPU, its linear kernel
(``kernels/cpu_linear.py``, ``SPECPLUG_CPU_LINEAR``), which takes the
target's small-row linear layers where it is bitwise equal to vLLM's
oneDNN path. Two uses: a CPU user who wants that kernel without
speculation, and the benchmarks' baseline that separates what a method's
trees earn (``speculation_speedup``) from what the kernel earns
(``kernel_speedup``). It is not speculative decoding.
"""

from __future__ import annotations

from vllm_specplug.config import MethodConfig
from vllm_specplug.engine.interface import Proposer, StepRequest
from vllm_specplug.engine.tree import DraftTree


class PlainConfig(MethodConfig):
    cost_aware: bool = False
    """Off: there are no trees to size, so the cost-aware budget would only
    measure steps it can never act on."""


class PlainProposer(Proposer):
    name = "plain"
    config_cls = PlainConfig

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        return [None] * len(batch)
