"""Host<->device copies (``engine/transfer.py``) and the greedy acceptance
and output the host predicts (``engine/verify.greedy_accepted``,
``greedy_output``), checked against vLLM's own rejection sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.engine import transfer
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.engine.verify import choose_paths, greedy_accepted, greedy_output


def test_read_back_packs_mixed_dtypes_and_shapes_in_one_copy(monkeypatch):
    """Every tensor as the host reads it, whatever its dtype, shape or
    offset in the packed bytes (one copy: ``cpu`` is called once)."""
    calls = []
    real_cpu = torch.Tensor.cpu

    def counted_cpu(self, *a, **k):
        calls.append(self.shape)
        return real_cpu(self, *a, **k)

    monkeypatch.setattr(transfer, "on_host", lambda t: t.dtype == torch.float16)
    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randint(0, 50000, (7,), generator=g),             # argmax rows, int64
        None,
        torch.rand(3, 5, generator=g, dtype=torch.float64),     # child draws
        torch.tensor([True, False, True]),                      # bool, 3 bytes
        torch.randn(2, 3, generator=g).to(torch.bfloat16),      # 12 bytes
        torch.randint(0, 9, (4, 2), dtype=torch.int32, generator=g)[:, 1],  # a strided view
        torch.randn(5, generator=g).half(),                     # "on the host": as it is
        torch.zeros(0, 3),                                      # empty
    ]
    got = transfer.read_back(*parts)
    assert len(calls) == 1
    assert got[1] is None and got[6] is parts[6]
    for want, have in zip(parts, got):
        if want is not None:
            assert have.dtype == want.dtype and have.shape == want.shape
            assert torch.equal(have, want)


def test_read_back_on_the_host_is_free():
    t = torch.arange(4)
    assert transfer.read_back(t, None)[0] is t
    assert transfer.to_device([1, 2], torch.long, "cpu").tolist() == [1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_accepted_is_what_vllms_rejection_sampler_accepts(seed):
    """Random trees and chains over random logits: the host's count, and the
    output it reads from the argmax rows, equal vLLM's greedy verdict on the
    chosen paths, verified as chains."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_specplug.runner.runner import apply_vllm_cpu_fixes
    from vllm_specplug.runner.verify_step import path_chain_metadata

    # what the CPU worker does at start-up: C++ stand-ins for Triton kernels
    if hasattr(current_platform, "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    apply_vllm_cpu_fixes()

    rng = np.random.default_rng(seed)
    vocab, n_req = 12, 5
    trees, drafts, rows = {}, [], []
    for i in range(n_req):
        m = int(rng.integers(1 if i == 0 else 0, 7))  # never all empty
        parents = [-1 if j == 0 else int(rng.integers(-1, j)) for j in range(m)]
        drafts.append([int(t) for t in rng.integers(0, vocab, m)])
        if i % 2 and m:
            trees[i] = DraftTree(drafts[i], parents)
        rows.append(m + 1)
    base = np.cumsum(rows) - rows
    logits = torch.randn(int(sum(rows)), vocab, generator=torch.Generator().manual_seed(seed))
    # make many drafts the argmax of the row that verifies them (their
    # parent's: the root's row is base, node p's is base + 1 + p)
    for i, toks in enumerate(drafts):
        parents = trees[i].parents if i in trees else list(range(-1, len(toks) - 1))
        for j, t in enumerate(toks):
            if rng.random() < 0.6:
                logits[base[i] + 1 + parents[j], t] += 10.0
    argmax = logits.argmax(-1).tolist()
    chosen = choose_paths(trees, drafts, base, set(range(n_req)), argmax, None)
    predicted = greedy_accepted(chosen.paths, drafts, base, argmax)

    meta, gather, _ = path_chain_metadata(chosen.paths, drafts, base, "cpu")
    sm = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n_req), presence_penalties=torch.zeros(n_req),
        repetition_penalties=torch.ones(n_req), output_token_ids=[[] for _ in range(n_req)],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    out = RejectionSampler(Sampler())(meta, None, logits[gather], sm)
    verdict = ((out.sampled_token_ids != -1).sum(-1) - 1).clamp(min=0).tolist()
    assert predicted == verdict
    # the whole output, read on the host: same tokens, padding, shape, dtype
    tokens, accepted = greedy_output(chosen.paths, drafts, base, argmax)
    assert accepted == verdict
    want = out.sampled_token_ids
    assert tokens.dtype == np.int32 and want.dtype == torch.int32
    assert tokens.tolist() == want.tolist()


def test_greedy_output_of_walks_stopped_at_their_roots_is_each_roots_argmax():
    """No path at all: one token per request, the argmax of its root row
    (what vLLM's plain sampler gives on the root rows)."""
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(3))
    base = np.array([0, 3, 5])
    drafts = [[1, 2], [4], [6]]
    tokens, accepted = greedy_output([[], [], []], drafts, base, logits.argmax(-1).tolist())
    assert accepted == [0, 0, 0]
    assert tokens.tolist() == [[int(logits[r].argmax())] for r in base]
