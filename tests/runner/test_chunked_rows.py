"""Per-row work in bounded chunks gives what the whole-tensor computation
gives: entropies, top-k, the relaxed rule's log-probabilities and the
sampled trees' child probabilities, on random inputs, chunked against
torch's own unchunked formulas."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest
import torch

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.engine.verify import child_draws_chunked, child_probs
from tests.helpers.cpu_kernels import cpu_kernels
from vllm_specplug.runner.logit_rows import (
    entropy,
    log_softmax_topk,
    sampled_child_probs,
    topk_ids,
    topk_probs,
)

VOCAB = 300


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g) * 3
    x[1, :50] = -float("inf")  # masked entries
    return x


@pytest.mark.parametrize("max_rows", [1, 3, 7, 1000])
def test_entropy_topk_logsoftmax_chunked(max_rows):
    x = _logits(23)
    rows = torch.tensor([22, 0, 5, 5, 1, 17, 9])
    p = torch.softmax(x, -1)
    ref_h = torch.special.entr(p).sum(-1)
    torch.testing.assert_close(entropy(x, max_rows=max_rows), ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy(x, rows, max_rows), ref_h[rows], atol=1e-4, rtol=1e-4)

    ref_v, ref_i = p[rows].topk(8, dim=-1)
    v, i = topk_probs(x, 8, rows, max_rows)
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(v, ref_v)
    assert torch.equal(topk_ids(x, 8, rows, max_rows), ref_i)  # ids without probs
    # greedy: the top-1 id is the argmax, exactly
    assert torch.equal(topk_probs(x, 1, max_rows=max_rows)[1][:, 0], x.argmax(-1))

    ref_lv, ref_li = torch.log_softmax(x[rows], -1).topk(5, dim=-1)
    lv, li = log_softmax_topk(x, 5, rows, max_rows)
    assert torch.equal(li, ref_li)
    torch.testing.assert_close(lv, ref_lv)


def test_no_rows():
    x = _logits(4)
    empty = torch.zeros(0, dtype=torch.long)
    assert entropy(x, empty, 2).shape == (0,)
    v, i = topk_probs(x, 3, empty, 2)
    assert v.shape == (0, 3) and i.shape == (0, 3)
    assert topk_ids(x, 3, empty, 2).shape == (0, 3)


def _random_trees(n: int, seed: int):
    rng = np.random.default_rng(seed)
    trees, drafts = {}, []
    for i in range(n):
        m = int(rng.integers(1, 7))
        parents = [-1] + [int(rng.integers(-1, j)) for j in range(1, m)]
        toks = [int(t) for t in rng.integers(0, VOCAB, m)]
        trees[i] = DraftTree(toks, parents)
        drafts.append(toks)
    return trees, drafts


@pytest.mark.parametrize("max_rows", [1, 5, 12, 1000])
def test_child_draws_chunked_match_whole(max_rows):
    trees, drafts = _random_trees(9, seed=max_rows)
    sampled = [0, 2, 3, 5, 6, 8]
    counts = {i: len(drafts[i]) + 1 for i in sampled}
    probs = torch.softmax(_logits(sum(counts.values()), seed=1), -1)
    sizes = np.array([counts[i] for i in sampled])
    base = {i: int(b) for i, b in zip(sampled, np.cumsum(sizes) - sizes)}

    def gens():  # request 3 seeded, the others on the global generator
        torch.manual_seed(7)
        return {3: torch.Generator().manual_seed(11)}

    ref = child_probs(trees, drafts, sampled, probs, base, gens())
    seen = []

    def probs_of(reqs):
        seen.append((sum(counts[i] for i in reqs), len(reqs)))
        return torch.cat([probs[base[i]: base[i] + counts[i]] for i in reqs])

    out = child_draws_chunked(trees, drafts, sampled, counts, probs_of, gens(),
                              max_rows).on_host()
    assert out.u == ref.u  # the same draws, exactly
    assert out.p.keys() == ref.p.keys()
    for i in ref.p:
        np.testing.assert_allclose(sum(out.p[i], []), sum(ref.p[i], []), rtol=1e-6)
    # at most max_rows rows a chunk, unless a single request has more
    assert all(rows <= max_rows or reqs == 1 for rows, reqs in seen)
    if max_rows < max(counts.values()):
        assert len(seen) > 1  # really chunked


def _metadata(n: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    g = torch.Generator().manual_seed(5)
    return SamplingMetadata(
        temperature=torch.rand(n, generator=g) + 0.3, all_greedy=False, all_random=True,
        top_p=torch.full((n,), 0.9), top_k=torch.randint(5, VOCAB, (n,), generator=g),
        generators={1: torch.Generator().manual_seed(3)}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


@pytest.mark.parametrize("max_rows", [2, 9, 1000])
def test_sampled_child_probs_matches_whole_tensor_softmax(max_rows):
    """The runner's path (whole requests per chunk under their own
    temperature/top-k/top-p) against one softmax over every sampled row."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    cpu_kernels()
    trees, drafts = _random_trees(6, seed=3)
    n_draft = np.array([len(d) for d in drafts])
    base = np.cumsum(n_draft + 1) - (n_draft + 1)
    logits = _logits(int((n_draft + 1).sum()), seed=2)
    sampled = [1, 2, 4, 5]
    sm = _metadata(len(drafts))
    # reference: every sampled row at once, per-row parameters written out
    sel = np.concatenate([base[i] + np.arange(n_draft[i] + 1) for i in sampled])
    owner = np.concatenate([[i] * (n_draft[i] + 1) for i in sampled])
    lg = logits[torch.as_tensor(sel)] / sm.temperature[owner].unsqueeze(-1)
    probs = torch.softmax(apply_top_k_top_p(lg, sm.top_k[owner], sm.top_p[owner]), -1)
    pb = {i: int(b) for i, b in zip(sampled, np.cumsum(n_draft[sampled] + 1)
                                     - (n_draft[sampled] + 1))}
    torch.manual_seed(1)
    ref = child_probs(trees, drafts, sampled, probs, pb,
                      {1: torch.Generator().manual_seed(3)})
    torch.manual_seed(1)
    out = sampled_child_probs(logits, trees, drafts, sampled, n_draft, base, sm,
                              max_rows).on_host()
    assert out.u == ref.u
    for i in ref.p:
        np.testing.assert_allclose(sum(out.p[i], []), sum(ref.p[i], []), rtol=1e-5)
