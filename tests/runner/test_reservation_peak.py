"""The memory the profile run reserves covers a real worst-case tree step.

A real step (the runner's own ``_sp_sample_trees`` + ``_sp_topk`` +
``_sp_entropy`` with vLLM's rejection sampler, every request a full tree,
every request sampled under top-k/top-p) and the profile run's
``reserve.worst_case_step`` run on CPU under torch's memory profiler; the
dummy step's peak and the reservation's arithmetic must both be at least
the real step's. The per-row chunks must also lower the real step's peak
against the unchunked computation."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vllm_specplug.engine.interface import Needs
from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.runner import memory, reserve
from vllm_specplug.runner.memory import StepShape, step_items
from vllm_specplug.runner.runner import SpecplugRunnerMixin, StepState
from vllm_specplug.runner.step_state import RequestBook
from tests.helpers.cpu_kernels import cpu_kernels

REQUESTS, NODES, VOCAB, HIDDEN = 8, 7, 4096, 32
# a chain of 5 under the root's first child and a sibling: paths up to 6 deep
DEEP = [-1, 0, 1, 2, 3, 4, -1]
# every node a child of the root: paths of one node, so the row work over
# the tree's rows is most of the step
WIDE = [-1] * NODES


def peak_bytes(fn) -> int:
    """Largest sum of live tensor bytes while ``fn`` runs (CPU), from the
    profiler's allocation timeline."""
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def test_peak_bytes_measures_live_tensors():
    x = torch.ones(1000)  # 4000 bytes

    def two_alive():
        a = x * 2
        b = a * 2
        return b.sum()

    assert 8000 <= peak_bytes(two_alive) < 12000


class _Runner(SpecplugRunnerMixin):
    """The mixin's verification methods on a hand-built batch."""

    def __init__(self, sm, sampler):
        self.input_batch = SimpleNamespace(
            sampling_metadata=sm, temperature_cpu=np.full(REQUESTS, 0.5, np.float32),
            req_ids=[f"r{i}" for i in range(REQUESTS)], num_reqs=REQUESTS)
        self.rejection_sampler = sampler
        self._sp_needs = Needs(topk=8, tree_topk=True, entropy=True)
        self._sp_stats = TreeStats()
        self._sp_requests = RequestBook()
        self._sp_options: dict = {}


def _sampler():
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    cpu_kernels()
    return RejectionSampler(Sampler())


def _real_step(logits: torch.Tensor, sampler, parents=DEEP):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    g = np.random.default_rng(0)
    drafts = [[int(t) for t in g.integers(0, VOCAB, NODES)] for _ in range(REQUESTS)]
    runner = _Runner(reserve.dummy_sampling_metadata(REQUESTS, VOCAB, "cpu"), sampler)
    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    state = StepState({i: DraftTree(d, parents) for i, d in enumerate(drafts)},
                      np.zeros(REQUESTS, np.int64), None)
    state.logit_rows = np.full(REQUESTS, NODES + 1, np.int64)
    state.logit_base = np.cumsum(state.logit_rows) - state.logit_rows

    def step():
        torch.manual_seed(0)
        runner._sp_sample_trees(logits, meta, state)
        runner._sp_topk(logits, state)
        runner._sp_entropy(logits, state)

    return step


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    lm = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    shape = StepShape(REQUESTS, NODES, 8192, VOCAB, 4)
    return lm, shape, _sampler()


def _chunk_of(rows: int) -> int:
    return rows * 4 * VOCAB  # CHUNK_BYTES giving ``rows`` rows a chunk


def test_reservation_covers_a_real_worst_case_step(setup, monkeypatch):
    lm, shape, sampler = setup
    monkeypatch.setattr(memory, "CHUNK_BYTES", _chunk_of(8))
    assert shape.chunk == 8 and shape.rows == 64
    with torch.inference_mode():
        logits = lm(torch.rand(shape.rows, HIDDEN))
    # the real step starts with the logits already there
    real = peak_bytes(_real_step(logits, sampler)) + logits.nbytes
    dummy = peak_bytes(lambda: reserve.worst_case_step(
        shape, lm, HIDDEN, torch.float32, sampler, "cpu"))
    assert dummy >= real, (dummy, real)
    assert sum(step_items(shape).values()) >= real


def test_chunks_lower_the_real_steps_peak(setup, monkeypatch):
    lm, shape, sampler = setup
    with torch.inference_mode():
        logits = lm(torch.rand(shape.rows, HIDDEN))
    monkeypatch.setattr(memory, "CHUNK_BYTES", _chunk_of(8))
    chunked = peak_bytes(_real_step(logits, sampler, WIDE))
    monkeypatch.setattr(memory, "CHUNK_BYTES", _chunk_of(10_000))  # one chunk
    whole = peak_bytes(_real_step(logits, sampler, WIDE))
    # unchunked, the tree rows' probabilities under top-k/top-p dominate
    assert chunked < 0.5 * whole, (chunked, whole)
