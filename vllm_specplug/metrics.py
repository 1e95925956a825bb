"""Tree metrics on the server's /metrics (a ``vllm.stat_logger_plugins``
entry point).

vLLM's spec-decode counters already hold the tree facts as sums (draft
tokens = tree nodes, accepted tokens = accepted depth, accepted per position
= drafts that reached each depth); this logger turns them into the series
trees need: ``specplug:tree_nodes`` and ``specplug:trees`` (mean tree size =
their ratio), ``specplug:accepted_depth_total`` and
``specplug:accepted_depth_drafts{depth="k"}`` (drafts whose accepted depth is
exactly k). It is idle for engines that run no specplug method.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_specplug.config import ADDITIONAL_CONFIG_KEY

_METRICS: dict[str, Counter] = {}


def _counter(name: str, doc: str, labels=()) -> Counter:
    # One set per process, even with several engines/loggers.
    if name not in _METRICS:
        _METRICS[name] = Counter(name, doc, ["method", *labels], registry=REGISTRY)
    return _METRICS[name]


class SpecplugStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        extra = getattr(vllm_config, "additional_config", None) or {}
        spec = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
        self.method = spec["method"] if spec else None
        if self.method is None:
            return
        self.trees = _counter("specplug:trees", "Draft trees verified")
        self.nodes = _counter("specplug:tree_nodes", "Draft tree nodes verified")
        self.depth = _counter("specplug:accepted_depth_total",
                              "Sum of accepted depths over draft trees")
        self.by_depth = _counter("specplug:accepted_depth_drafts",
                                 "Draft trees by exact accepted depth", ["depth"])
        for c in (self.trees, self.nodes, self.depth):
            c.labels(self.method)  # exported from start-up, at 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        if self.method is None or scheduler_stats is None:
            return
        sd = getattr(scheduler_stats, "spec_decoding_stats", None)
        if sd is None or not sd.num_drafts:
            return
        m = self.method
        self.trees.labels(m).inc(sd.num_drafts)
        self.nodes.labels(m).inc(sd.num_draft_tokens)
        self.depth.labels(m).inc(sd.num_accepted_tokens)
        # per_pos[k] counts drafts that reached depth k+1.
        reached = [sd.num_drafts, *sd.num_accepted_tokens_per_pos, 0]
        for k in range(len(reached) - 1):
            exact = reached[k] - reached[k + 1]
            if exact:
                self.by_depth.labels(m, str(k)).inc(exact)

    def log_engine_initialized(self) -> None:
        pass
