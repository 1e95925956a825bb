"""Counters of the tree engine, beside vLLM's own spec-decode counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_specplug.engine.tree import DraftTree


@dataclass
class TreeStats:
    steps: int = 0
    drafts: int = 0
    tree_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    budget_faults: int = 0
    """Steps whose cost-aware cut raised (the trees were verified uncut)."""
    kv_moves: int = 0
    preempted: int = 0
    """Requests the scheduler preempted (their trees and method state are
    dropped; they come back through a recompute prefill)."""
    propose_faults: int = 0
    """Steps where the method's propose raised or returned an unusable tree
    (``runner/guard.py``)."""
    fault_requests: int = 0
    """Requests that decoded without speculation for a step after a fault."""
    rank_divergences: int = 0
    """Steps where this rank's trees differed from rank 0's (tensor
    parallelism; rank 0's are verified)."""
    hook_faults: int = 0
    """Calls of the method's other hooks (``add_request``,
    ``remove_request``, ``catch_up_rows``, ``stats``) that raised; the
    request went on decoding (``runner/guard.py``)."""
    requests_stopped_drafting: int = 0
    """Requests that stopped drafting for good after ``max_request_faults``
    faults in a row."""
    relaxed_tokens: int = 0
    """Draft tokens accepted by the LOSSY relaxed rule against the target's
    argmax (``Needs.relaxed``; 0 unless a method opts in)."""
    relaxed_ineligible: int = 0
    """Request steps served strictly although the method asks for relaxed
    verification (sampled, logprobs or penalties)."""
    relaxed_opted_out: int = 0
    """Request steps served strictly because the request did not ask for
    relaxed verification (``specplug_relaxed``; ``request_flags``)."""
    accepted_depth_hist: dict[int, int] = field(default_factory=dict)
    tree_size_hist: dict[int, int] = field(default_factory=dict)
    collect_seconds: float = 0.0
    propose_seconds: float = 0.0
    propose_calls: int = 0
    source_nodes: dict[str, int] = field(default_factory=dict)
    """Verified draft nodes per ``DraftTree.sources`` name."""
    source_accepted: dict[str, int] = field(default_factory=dict)
    """Accepted draft tokens per source: which drafter earned them."""

    def record_sources(self, tree: DraftTree, accepted) -> None:
        """One verified tree with ``sources`` (the nodes the step kept) and
        the tokens the target accepted after its root (bonus excluded)."""
        for s in tree.sources:
            self.source_nodes[s] = self.source_nodes.get(s, 0) + 1
        node, _ = tree.follow(accepted)
        while node >= 0:
            s = tree.sources[node]
            self.source_accepted[s] = self.source_accepted.get(s, 0) + 1
            node = tree.parents[node]

    def _record(self, n_draft, accepted) -> None:
        self.steps += 1
        for n, a in zip(n_draft, accepted):
            if n <= 0:
                continue
            self.drafts += 1
            self.draft_tokens += n
            self.accepted_tokens += a
            self.accepted_depth_hist[a] = self.accepted_depth_hist.get(a, 0) + 1
            self.tree_size_hist[n] = self.tree_size_hist.get(n, 0) + 1

    def record_chains(self, n_draft, accepted_plus_bonus) -> None:
        self._record(n_draft, [max(a - 1, 0) for a in accepted_plus_bonus])

    def record_trees(self, n_draft, accepted, trees) -> None:
        self.tree_drafts += len(trees)
        self._record(n_draft, accepted)

    def record_propose(self, collect: float, propose: float) -> None:
        self.collect_seconds += collect
        self.propose_seconds += propose
        self.propose_calls += 1

    def as_dict(self) -> dict:
        # Deep enough that callers' snapshots never alias the live histograms.
        d = {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}
        d["mean_tree_size"] = self.draft_tokens / self.drafts if self.drafts else 0.0
        d["mean_accepted_length"] = (
            1 + self.accepted_tokens / self.drafts if self.drafts else 1.0
        )
        return d


def ema(old: float | None, x: float, alpha: float) -> float:
    """Exponential moving average: ``x`` moves ``old`` by ``alpha`` of the
    difference (``x`` itself when there is no ``old`` yet)."""
    return x if old is None else old + alpha * (x - old)


def cost_ema(old: float | None, x: float, alpha: float, max_rise: float) -> float:
    """A measured cost into its estimate. Contention and one-time work only
    ever add time, so a cheaper ``x`` moves ``old`` half-way at once and a
    dearer one by ``alpha``, counted at most ``max_rise`` times ``old``: one
    slow measurement cannot price a cost out for long."""
    if old is not None and x < old:
        return old + 0.5 * (x - old)
    return capped_ema(old, x, alpha, max_rise)


def capped_ema(old: float | None, x: float, alpha: float, max_rise: float) -> float:
    """``ema`` with ``x`` counted at most ``max_rise`` times ``old``."""
    return x if old is None else ema(old, min(x, max_rise * old), alpha)


class RunningStat:
    """Count / mean / min / max / last of a stream of durations (seconds)."""

    __slots__ = ("n", "total", "min", "max", "last")

    def __init__(self) -> None:
        self.n, self.total, self.min, self.max, self.last = 0, 0.0, float("inf"), 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        self.min = min(self.min, x)
        self.max = max(self.max, x)
        self.last = x

    def as_ms(self) -> dict:
        if not self.n:
            return {"n": 0}
        return {"n": self.n, "mean_ms": 1e3 * self.total / self.n, "min_ms": 1e3 * self.min,
                "max_ms": 1e3 * self.max, "last_ms": 1e3 * self.last,
                "total_s": self.total}
