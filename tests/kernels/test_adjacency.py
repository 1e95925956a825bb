"""Adjacency-table kernels (interpreted) vs. torch references and plain loops."""

import random

import pytest
import torch

from vllm_specplug.kernels.adjacency import (
    adjacency_update,
    adjacency_update_ref,
    adjacency_update_triton,
    template_depth,
    template_expand,
    template_expand_ref,
    template_expand_triton,
)

VOCAB, K = 1000, 8


def _table(seed, vocab=VOCAB, k=K):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, k), generator=gen, dtype=torch.int32)


def _loop_update(table, tokens, topk):
    out = table.clone()
    for tok, row in zip(tokens.tolist(), topk):
        if 0 <= tok < out.shape[0]:
            out[tok] = row.to(out.dtype)  # later rows overwrite: last occurrence wins
    return out


def _loop_expand(table, roots, parents, ranks):
    out = torch.empty(len(roots), len(parents), dtype=roots.dtype)
    for b, root in enumerate(roots.tolist()):
        for t, (p, r) in enumerate(zip(parents, ranks)):
            tok = root if p < 0 else int(out[b, p])
            out[b, t] = table[tok, r] if 0 <= tok < table.shape[0] and 0 <= r < table.shape[1] else -1
    return out


@pytest.mark.parametrize("order", ["forward", "reversed"])
@pytest.mark.parametrize("n,distinct", [(301, 40), (77, 1000), (5, 2)])
def test_update_last_duplicate_wins(n, distinct, order, request):
    if order == "reversed":
        request.getfixturevalue("reversed_programs")
    gen = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, distinct, (n,), generator=gen)
    tokens[::17] = -1  # padding entries are skipped
    tokens[3] = VOCAB  # out of range: skipped too
    topk = torch.randint(0, VOCAB, (n, K), generator=gen)  # int64, as torch.topk returns
    want = _loop_update(_table(1), tokens, topk)
    got, ref = _table(1), _table(1)
    adjacency_update_triton(got, tokens, topk)
    adjacency_update_ref(ref, tokens, topk)
    assert torch.equal(got, want)
    assert torch.equal(ref, want)


def test_update_strided_inputs_and_dispatch():
    """Odd k, non-contiguous topk rows (a column slice of logits-sized ids)."""
    k = 5
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 30, (50,), generator=gen, dtype=torch.int32)
    topk = torch.randint(0, VOCAB, (50, 2 * k), generator=gen)[:, ::2]
    table = _table(3, k=k)
    want = _loop_update(table, tokens, topk)
    adjacency_update(table, tokens, topk)
    assert torch.equal(table, want)


def _templates():
    rng = random.Random(0)
    random_70 = [-1] + [rng.randrange(-1, t) for t in range(1, 70)]
    chain = list(range(-1, 23))
    wide = [-1] * 8 + [rng.randrange(8) for _ in range(61)]  # depth 2, 69 nodes
    return {"random_70": random_70, "chain_24": chain, "wide_69": wide}


def _ranks(parents, seed):
    """Rank = index among siblings (as a template builder would assign), capped below K."""
    rng = random.Random(seed)
    seen = {}
    ranks = []
    for p in parents:
        ranks.append(min(seen.get(p, 0), K - 1) if rng.random() < 0.8 else rng.randrange(K))
        seen[p] = seen.get(p, 0) + 1
    return ranks


@pytest.mark.parametrize("name", sorted(_templates()))
def test_template_expand(name):
    parents = _templates()[name]
    ranks = _ranks(parents, seed=len(parents))
    table = _table(4)
    table[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:50], 2] = -1  # unknown
    roots = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(6))
    roots[5] = -1  # a padded batch row expands to all -1
    parent_idx = torch.tensor(parents, dtype=torch.int32)
    rank = torch.tensor(ranks, dtype=torch.int32)
    want = _loop_expand(table, roots, parents, ranks)
    assert (want == -1).any() and (want >= 0).any()
    got = template_expand_triton(table, roots, parent_idx, rank, depth=template_depth(parent_idx))
    assert got.dtype == roots.dtype and got.shape == (8, len(parents))
    assert torch.equal(got, want)
    assert torch.equal(template_expand_ref(table, roots, parent_idx, rank), want)
    assert torch.equal(template_expand(table, roots.int(), parent_idx, rank), want.int())


def test_template_depth():
    assert template_depth([-1, 0, 1, 0, -1, 4]) == 3
    assert template_depth(torch.tensor(list(range(-1, 23)))) == 24
    assert template_depth([]) == 0
    with pytest.raises(ValueError):
        template_depth([-1, 3, 0, 1])
