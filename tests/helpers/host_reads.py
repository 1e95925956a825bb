"""Device->host reads per step, counted on the real engine (the ``reads``
fixture, used by the recycle and adapld engine tests, whose engines these
checks share).

On a GPU each read of a device tensor from the host waits for the device.
A tree step reads it once to choose its paths (the argmax rows and the
sampled walks' draws in one copy) and, where every request is greedy and
nothing changes the rows vLLM verifies, not again after verification;
sampling reads vLLM's verdict once more. A method that reads its rows on the
host (``Needs.rows_on_host``) gets the whole batch's in one copy, never one
per request.

The CPU has no device, so the fixture marks one: the logits, vLLM's draft
tensor, its samplers' outputs and the hidden states are wrapped in
``OnDevice``, every tensor computed from them stays one, and a
``TorchFunctionMode`` counts each read of one (``tolist``, ``item``, ``cpu``,
``numpy``, ``bool``/``int``/``float``...) made by the plugin's own code.
Reads of what a method keeps itself (an adjacency table's expansion) are not
counted: only reads of what the target computed. Nor is the adjacency
table's update, which is numpy on a CPU table and a Triton kernel on the
device (``kernels/adjacency``) on a GPU.

The patches are on classes, so they reach an engine already running in this
process (the tests run vLLM in-process) from the moment the fixture is set up.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

_READS = {"tolist", "item", "cpu", "numpy", "__array__", "__bool__", "__int__",
          "__float__", "__index__"}
_HOST_ONLY = {"vllm_specplug.sources.adjacency"}
"""Modules whose reads here are a CPU table's own path (see the module doc)."""


class OnDevice(torch.Tensor):
    """A tensor that stands for device memory."""


def _dev(t):
    return t.as_subclass(OnDevice) if isinstance(t, torch.Tensor) else t


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, OnDevice) else t


class CountReads(TorchFunctionMode):
    """Counts the plugin's reads of ``OnDevice`` tensors; a read's result is
    a host tensor (plain)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS and args and isinstance(args[0], OnDevice):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("vllm_specplug") and module not in _HOST_ONLY:
                self.count += 1
                self.where.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {name}")
            return _plain(func(*args, **kwargs))
        return func(*args, **kwargs)


@pytest.fixture
def reads(monkeypatch):
    """Per ``_sample`` call: (trees in the step, all greedy, reads); per
    ``propose_draft_token_ids`` call: (requests, reads, where)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_specplug.engine import transfer
    from vllm_specplug.runner.draft import DraftMixin
    from vllm_specplug.runner.verify_step import VerifyMixin

    log = {"sample": [], "propose": []}
    monkeypatch.setattr(transfer, "on_host", lambda t: not isinstance(t, OnDevice))
    for cls in (RejectionSampler, Sampler):
        def forward(self, *a, _fwd=cls.forward, **k):
            out = _fwd(self, *a, **k)
            return dataclasses.replace(out, sampled_token_ids=_dev(out.sampled_token_ids))
        monkeypatch.setattr(cls, "forward", forward)

    sample = VerifyMixin._sample

    def counted_sample(self, logits, meta):
        state = self._sp_state
        trees = bool(state is not None and state.trees)
        greedy_all = bool(self.input_batch.sampling_metadata.all_greedy)
        if meta is not None:
            meta = dataclasses.replace(meta, draft_token_ids=_dev(meta.draft_token_ids))
        with CountReads() as c:
            out = sample(self, _dev(logits), meta)
        log["sample"].append((trees, greedy_all, c.count, c.where))
        return dataclasses.replace(out, sampled_token_ids=_plain(out.sampled_token_ids))

    propose = DraftMixin.propose_draft_token_ids

    def counted_propose(self, scheduler_output, sampled_token_ids, sampling_metadata,
                        hidden_states, sample_hidden_states, aux_hidden_states, *rest):
        aux = [_dev(a) for a in aux_hidden_states] if aux_hidden_states else aux_hidden_states
        with CountReads() as c:
            out = propose(self, scheduler_output, sampled_token_ids, sampling_metadata,
                          _dev(hidden_states), sample_hidden_states, aux, *rest)
        log["propose"].append((self.input_batch.num_reqs, c.count, c.where))
        return out

    monkeypatch.setattr(VerifyMixin, "_sample", counted_sample)
    monkeypatch.setattr(DraftMixin, "propose_draft_token_ids", counted_propose)
    return log
