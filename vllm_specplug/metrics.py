"""Tree metrics on the server's /metrics (a ``vllm.stat_logger_plugins``
entry point).

vLLM's spec-decode counters already hold the tree facts as sums (draft
tokens = tree nodes, accepted tokens = accepted depth, accepted per position
= drafts that reached each depth); this logger turns them into the series
trees need: ``specplug:tree_nodes`` and ``specplug:trees`` (mean tree size =
their ratio), ``specplug:accepted_depth_total`` and
``specplug:accepted_depth_drafts{depth="k"}`` (drafts whose accepted depth is
exactly k). It is idle for engines that run no specplug method.

The runner's integer counters (``specplug_stats``: ``propose_faults``,
``fault_requests``, ``hook_faults``, ``kv_moves``, ...) live in the worker
processes and reach this logger on vLLM's own stats path, with no file in
between:

1. worker (:class:`WorkerCounters`): when they changed, the counters ride on
   the step's ``ModelRunnerOutput`` as an extra attribute (pickled to the
   engine core with the output; never on vLLM's shared empty output);
2. engine core (:func:`install_scheduler_hooks`): ``Scheduler.update_from_output``
   keeps the latest counters, ``Scheduler.make_stats`` turns them into
   increments since the last stats and adds them to
   ``SchedulerStats.num_kv_fetch_reqs_by_stage`` (the one free-keyed int
   field vLLM's msgpack carries to the front end) as ``specplug:<name>``;
3. front end: a hook on vLLM's ``StatLoggerManager.record`` moves those
   keys out of the dict before any logger sees it (:func:`set_aside`); this
   logger adds them to ``specplug:<name>``.

Increments, not totals, cross to the front end: with several API server
processes vLLM hands each step's stats to one of them, and Prometheus'
multiprocess mode sums the processes. Limits (vLLM's): only the output rank's
runner output reaches the engine core (tensor parallelism: rank 0, whose
trees every rank verifies; each rank's own counters stay in
``specplug_stats``); counters of a step that returns no output (an idle
engine) arrive with the next one.
"""

from __future__ import annotations

import functools
import logging
import os
import re

from prometheus_client import REGISTRY, Counter
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_specplug.config import ADDITIONAL_CONFIG_KEY

_METRICS: dict[str, Counter] = {}


def _counter(name: str, doc: str, labels=()) -> Counter:
    # One set per process, even with several engines/loggers.
    if name not in _METRICS:
        _METRICS[name] = Counter(name, doc, ["method", *labels], registry=REGISTRY)
    return _METRICS[name]


logger = logging.getLogger("vllm.specplug")

COUNTERS_ATTR = "_specplug_counters"
"""The ``ModelRunnerOutput`` attribute a worker's counters ride on."""
STATS_PREFIX = "specplug:"
"""Prefix of the counters' keys in ``SchedulerStats.num_kv_fetch_reqs_by_stage``."""
EPOCH = "epoch"
"""Key of a worker process's random id: counters of a new one start from 0."""
RANK_LOCAL = frozenset({"rank_divergences"})
"""Counters only ranks other than the output rank ever count: /metrics never
sees those ranks, so exporting rank 0's constant 0 would mislead."""
_MAX_COUNT = 1 << 62  # msgpack carries int64; anything larger is not a counter
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_MAX_NAMES = 64  # a runaway worker cannot create unbounded series

WORKER_COUNTER_DOCS = {
    "propose_faults": "Steps where the method's propose raised or returned an unusable "
                      "tree (those requests decoded without speculation)",
    "fault_requests": "Requests that fell back to no speculation for a step because of "
                      "a method fault",
    "hook_faults": "Faults in the method's other hooks (add_request, remove_request, "
                   "catch_up_rows, stats); the request goes on decoding",
    "requests_stopped_drafting": "Requests that stopped drafting after too many faults "
                                 "in a row (max_request_faults)",
}
"""Counters exported (at 0) from start-up, with their help text; any other
integer counter of the runner is exported when it first moves."""
_TREE_SERIES = frozenset({"trees", "tree_nodes", "accepted_depth", "accepted_depth_total",
                          "accepted_depth_drafts"})


def valid_counters(raw) -> dict[str, int]:
    """The well-formed entries of a counters mapping: lower-case metric-safe
    names (not a Prometheus suffix) with ``int`` values in [0, 2**62).
    Anything else is dropped, never raised: the values cross process
    boundaries and a bad one must cost a metric, not the engine."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items()
            if isinstance(k, str) and _NAME.fullmatch(k) and k != EPOCH
            and not k.endswith(("_total", "_created"))
            and type(v) is int and 0 <= v < _MAX_COUNT}


SOURCE_SERIES = {
    "source_nodes": ("specplug:source_nodes", "Draft tree nodes verified, by the node's source"),
    "source_accepted": ("specplug:source_accepted_tokens",
                        "Accepted draft tokens, by the source of the node that earned them"),
}
"""``TreeStats`` dicts by source name (``DraftTree.sources``), exported as one
labelled counter each. They travel as ``<series>__<source>`` counters."""
_SOURCE_SEP = "__"
_MAX_SOURCES = 32  # label values per series: a method names a few sources


@functools.lru_cache(maxsize=1024)
def source_label(source: str) -> str:
    """A source name as a metric-safe label (and counter-key) part.
    Cached: every step labels each source's counts again, and a method
    names only a few sources."""
    return re.sub(r"[^a-z0-9_]", "_", str(source).lower())[:40] or "none"


def worker_counters(stats) -> dict[str, int]:
    """Every integer counter of the runner's ``TreeStats`` (new ones included
    without a change here), minus the rank-local ones, plus the per-source
    counts (``SOURCE_SERIES``, the first ``_MAX_SOURCES`` sources each)."""
    out = {k: v for k, v in vars(stats).items() if type(v) is int and k not in RANK_LOCAL}
    for series in SOURCE_SERIES:
        by_source = getattr(stats, series, None)
        if not isinstance(by_source, dict):
            continue
        for source, n in list(by_source.items())[:_MAX_SOURCES]:
            key = f"{series}{_SOURCE_SEP}{source_label(source)}"
            out[key] = out.get(key, 0) + int(n)
    return out


class WorkerCounters:
    """Worker side: puts the runner's counters on the step's output when
    they changed since they were last put on one. They are totals, so an
    output that never reaches the engine core costs nothing but a delay."""

    def __init__(self) -> None:
        self.epoch = int.from_bytes(os.urandom(7), "little")
        """This worker process's id: the engine core restarts its increments
        when it changes (a restarted worker counts from 0)."""
        self._sent: dict[str, int] | None = None

    def attach(self, output, counters: dict[str, int]) -> bool:
        """Put ``counters`` on ``output`` (a ``ModelRunnerOutput``, or vLLM's
        asynchronous wrapper of one) if they changed; True when put."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        target = getattr(output, "_model_runner_output", output)
        # The empty output is one object shared by every step: never write on it.
        if not isinstance(target, ModelRunnerOutput) or target is EMPTY_MODEL_RUNNER_OUTPUT:
            return False
        if counters == self._sent:
            return False
        setattr(target, COUNTERS_ATTR, {**counters, EPOCH: self.epoch})
        self._sent = dict(counters)
        return True


class EngineCounters:
    """Engine-core side, one per scheduler: the latest counters from the
    workers, turned into increments since the last stats."""

    def __init__(self) -> None:
        self.latest = None
        self.epoch = None
        self.sent: dict[str, int] = {}

    def observe(self, model_runner_output) -> None:
        counters = getattr(model_runner_output, COUNTERS_ATTR, None)
        if counters is not None:
            self.latest = counters

    def increments(self) -> dict[str, int]:
        """``specplug:<name>`` -> increment since the last call (non-zero
        only); the latest counters are consumed."""
        raw, self.latest = self.latest, None
        if not isinstance(raw, dict):
            return {}
        epoch = raw.get(EPOCH)
        if epoch != self.epoch:  # another worker process: its counters start at 0
            self.epoch, self.sent = epoch, {}
        out = {}
        for name, total in valid_counters(raw).items():
            old = self.sent.get(name, 0)
            step = total - old if total >= old else total  # went back: a reset
            if step:
                out[STATS_PREFIX + name] = step
            self.sent[name] = total
        return out

    def add_to(self, scheduler_stats) -> None:
        increments = self.increments()
        if increments:
            scheduler_stats.num_kv_fetch_reqs_by_stage.update(increments)


def _engine_counters(scheduler) -> EngineCounters:
    counters = scheduler.__dict__.get("_specplug_engine_counters")
    if counters is None:
        counters = scheduler._specplug_engine_counters = EngineCounters()
    return counters


def _quietly(what: str, fn) -> None:
    """Metrics are best effort: a fault here is logged once, never raised
    into vLLM's scheduler."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        if what not in _quietly.logged:
            _quietly.logged.add(what)
            logger.warning("specplug: worker counters not forwarded (%s: %s: %s)",
                           what, type(e).__name__, e)


_quietly.logged = set()


def install_scheduler_hooks(scheduler_cls=None) -> None:
    """Wrap ``update_from_output`` (keep the workers' counters from the
    runner output) and ``make_stats`` (add their increments to the stats) of
    vLLM's ``Scheduler`` (or ``scheduler_cls``); ``AsyncScheduler`` inherits
    both. Idempotent: ``register`` runs more than once per process."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if getattr(scheduler_cls.make_stats, "_specplug", False):
        return
    update, make = scheduler_cls.update_from_output, scheduler_cls.make_stats

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        # Before vLLM's own: it calls make_stats itself.
        _quietly("update_from_output", lambda: _engine_counters(self).observe(
            model_runner_output))
        return update(self, scheduler_output, model_runner_output, *args, **kwargs)

    def make_stats(self, *args, **kwargs):
        stats = make(self, *args, **kwargs)
        if stats is not None:
            _quietly("make_stats", lambda: _engine_counters(self).add_to(stats))
        return stats

    update_from_output._specplug = make_stats._specplug = True
    scheduler_cls.update_from_output = update_from_output
    scheduler_cls.make_stats = make_stats


def install_stats_hooks() -> None:
    """Every process's part of the path: the scheduler hooks (engine core)
    and the stat logger manager's (front end)."""
    install_scheduler_hooks()
    install_front_end_hook()


def install_front_end_hook() -> None:
    """Set the counters aside (:func:`set_aside`) before vLLM's
    ``StatLoggerManager`` hands the stats to any logger, so that neither
    vLLM's loggers (its log line prints unknown KV-fetch stages) nor a
    user's own see them, offline engines included (they load no plugin
    logger: the counters are then simply dropped)."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    if getattr(StatLoggerManager.record, "_specplug", False):
        return
    record = StatLoggerManager.record

    def record_with_counters_aside(self, scheduler_stats, *args, **kwargs):
        if scheduler_stats is not None:
            _quietly("record", lambda: set_aside(scheduler_stats))
        return record(self, scheduler_stats, *args, **kwargs)

    record_with_counters_aside._specplug = True
    StatLoggerManager.record = record_with_counters_aside


ASIDE_ATTR = "_specplug_increments"
"""Where :func:`set_aside` moves the counters, on the stats object itself."""


def set_aside(scheduler_stats) -> None:
    """Move the ``specplug:`` keys out of ``num_kv_fetch_reqs_by_stage`` onto
    an attribute of the stats that only this package's logger reads."""
    by_stage = getattr(scheduler_stats, "num_kv_fetch_reqs_by_stage", None)
    if not isinstance(by_stage, dict):
        return
    keys = [k for k in by_stage if isinstance(k, str) and k.startswith(STATS_PREFIX)]
    if keys:
        aside = scheduler_stats.__dict__.setdefault(ASIDE_ATTR, {})
        for k in keys:
            aside[k] = by_stage.pop(k)


def take_worker_counters(scheduler_stats) -> dict[str, int]:
    """The valid increments the stats carry, by counter name, taken out of
    them (set aside by the manager's hook, or still in the stats' dict)."""
    if scheduler_stats is None:
        return {}
    set_aside(scheduler_stats)
    raw = getattr(scheduler_stats, "__dict__", {}).pop(ASIDE_ATTR, None) or {}
    return valid_counters({k[len(STATS_PREFIX):]: v for k, v in raw.items()})


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
        self._worker: dict[str, Counter | None] = {}
        self._sources: dict[str, set[str]] = {}  # per source series: labels exported
        for name in WORKER_COUNTER_DOCS:
            self._worker_counter(name)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        # Taken out even when idle: the keys are not vLLM's own loggers' business.
        _quietly("record", lambda: self._count_worker_counters(scheduler_stats))
        if self.method is None:
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

    def _count_worker_counters(self, scheduler_stats) -> None:
        increments = take_worker_counters(scheduler_stats)
        if self.method is None:
            return
        for name, step in increments.items():
            series, sep, source = name.partition(_SOURCE_SEP)
            if sep and series in SOURCE_SERIES:
                self._count_source(series, source, step)
                continue
            counter = self._worker_counter(name)
            if counter is not None:
                counter.labels(self.method).inc(step)

    def _count_source(self, series: str, source: str, step: int) -> None:
        seen = self._sources.setdefault(series, set())
        if source not in seen and len(seen) >= _MAX_SOURCES:
            return
        seen.add(source)
        name, doc = SOURCE_SERIES[series]
        _counter(name, doc, ["source"]).labels(self.method, source).inc(step)

    def _worker_counter(self, name: str) -> Counter | None:
        """``specplug:<name>``, created on first use (None: a name that would
        clash with the tree series, or one too many)."""
        if name in self._worker:
            return self._worker[name]
        counter = None
        if name not in _TREE_SERIES and len(self._worker) < _MAX_NAMES:
            doc = WORKER_COUNTER_DOCS.get(
                name, f"Runner counter {name} (specplug_stats, output rank)")
            try:
                counter = _counter(STATS_PREFIX + name, doc)
                counter.labels(self.method)
            except ValueError:  # already taken in the registry
                counter = None
        self._worker[name] = counter
        return counter

    def log_engine_initialized(self) -> None:
        pass
