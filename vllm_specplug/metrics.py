"""Tree metrics on the server's /metrics (a ``vllm.stat_logger_plugins``
entry point).

vLLM's spec-decode counters already hold the tree facts as sums (draft
tokens = tree nodes, accepted tokens = accepted depth, accepted per position
= drafts that reached each depth); this logger turns them into the series
trees need: ``specplug:tree_nodes`` and ``specplug:trees`` (mean tree size =
their ratio), ``specplug:accepted_depth_total`` and
``specplug:accepted_depth_drafts{depth="k"}`` (drafts whose accepted depth is
exactly k). It is idle for engines that run no specplug method.

The runner's fault counters (``specplug:propose_faults``: steps where the
method raised or returned an unusable tree; ``specplug:fault_requests``:
requests that decoded without speculation because of it) are not part of
vLLM's scheduler stats: each worker rank writes them to a small JSON file
(:class:`WorkerStatsFile`, when they change) named by an id the front end puts
in the environment its engine processes inherit (``SPECPLUG_STATS_ID``), and
this logger, in the API server's process, exports them.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time

from prometheus_client import REGISTRY, Counter
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_specplug.config import ADDITIONAL_CONFIG_KEY

_METRICS: dict[str, Counter] = {}


def _counter(name: str, doc: str, labels=()) -> Counter:
    # One set per process, even with several engines/loggers.
    if name not in _METRICS:
        _METRICS[name] = Counter(name, doc, ["method", *labels], registry=REGISTRY)
    return _METRICS[name]


STATS_ID_ENV = "SPECPLUG_STATS_ID"


def stats_id() -> str:
    """The id that names this server's worker stats files: set once in the
    front end (``plugin.rewrite``), inherited by every engine process it
    starts. (vLLM's ``instance_id`` is not: each process re-derives it.) An
    id inherited from a parent process is replaced: two servers started from
    one shell must not share files."""
    if not os.environ.get(STATS_ID_ENV, "").startswith(f"{os.getpid()}-"):
        os.environ[STATS_ID_ENV] = f"{os.getpid()}-{os.urandom(4).hex()}"
    return os.environ[STATS_ID_ENV]


def worker_stats_glob(sid: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"specplug-stats-{sid}-rank*.json")


class WorkerStatsFile:
    """A worker rank's runner counters, for the front end's logger."""

    def __init__(self, sid: str, rank: int, min_interval: float = 1.0) -> None:
        self.path = worker_stats_glob(sid).replace("*", str(rank))
        self.min_interval = min_interval
        self._last_write = 0.0
        self._last: dict | None = None

    def __call__(self, counters: dict, force: bool = False) -> None:
        now = time.monotonic()
        if counters == self._last or (not force and now - self._last_write < self.min_interval):
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({**counters, "pid": os.getpid()}, f)
            os.replace(tmp, self.path)  # readers never see half a file
        except OSError:
            return  # metrics are best effort; serving goes on
        self._last, self._last_write = dict(counters), now


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
        self.faults = _counter("specplug:propose_faults",
                               "Steps where the method's propose raised or returned an "
                               "unusable tree (those requests decoded without speculation)")
        self.fault_requests = _counter("specplug:fault_requests",
                                       "Requests that fell back to no speculation for a "
                                       "step because of a method fault")
        for c in (self.trees, self.nodes, self.depth, self.faults, self.fault_requests):
            c.labels(self.method)  # exported from start-up, at 0
        self._files = worker_stats_glob(stats_id())
        self._seen: dict[str, dict] = {}
        self._mtimes: dict[str, float] = {}
        self._since = time.time() - 1  # files of engines before this one are stale
        self._next_read = 0.0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        if self.method is None or scheduler_stats is None:
            return
        self._read_worker_files()
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

    def _read_worker_files(self) -> None:
        now = time.monotonic()
        if now < self._next_read:  # record() runs every step: look once a second
            return
        self._next_read = now + 1.0
        for path in glob.glob(self._files):
            try:
                mtime = os.stat(path).st_mtime
                if self._mtimes.get(path) == mtime or mtime < self._since:
                    continue
                with open(path) as f:
                    new = json.load(f)
            except (OSError, ValueError):
                continue
            self._mtimes[path] = mtime
            old = self._seen.get(path, {})
            if old.get("pid") != new.get("pid"):
                old = {}  # another worker process (a restarted engine) counts from 0
            m = self.method
            for key, counter in (("propose_faults", self.faults),
                                 ("fault_requests", self.fault_requests)):
                delta = new.get(key, 0) - old.get(key, 0)
                if delta > 0:
                    counter.labels(m).inc(delta)
            self._seen[path] = new

    def log_engine_initialized(self) -> None:
        pass
