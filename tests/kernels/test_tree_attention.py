"""tree_attention_triton (interpreted) vs. the dense torch reference."""

import random

import pytest
import torch

from vllm_specplug.kernels.tree_attention import (
    pack_tree_mask,
    tree_attention,
    tree_attention_ref,
    tree_attention_triton,
    tree_mask_from_parents,
)

BLOCK_SIZE = 16
NUM_KV_HEADS = 2


def _random_parents(n, rng):
    return [-1] + [rng.randrange(t) for t in range(1, n)]


def _tree_specs(rng):
    """(ctx_len, parents or None, q_len): trees of several shapes plus causal seqs."""
    return [
        (35, list(range(-1, 6)), 7),  # chain, context crosses two block boundaries
        (16, [-1] + [0] * 9, 10),  # wide: root + 9 siblings; context = exactly one block
        (50, [-1] + [(t - 1) // 2 for t in range(1, 15)], 15),  # deep binary tree
        (3, _random_parents(21, rng), 21),  # random parents, tiny context
        (47, [-1], 1),  # decode: a one-node tree
        (0, None, 37),  # prefill-like causal, spans several q-blocks
        (21, None, 5),  # causal with context
        (30, None, 1),  # causal decode
    ]


def _make_batch(specs, head_dim, qpk, dtype, seed=0, extra_blocks=3):
    """Random varlen batch on a shuffled paged cache laid out like vLLM's
    per-layer ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for _, _, q in specs]
    seq_lens = [c + q for c, _, q in specs]
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # a padded, partly unused table column
    num_blocks = sum(blocks_per_seq) + extra_blocks
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = kv.unbind(0)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):
        block_table[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, NUM_KV_HEADS * qpk, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    tree_mask = torch.zeros(num_tokens, dtype=torch.int64)
    is_tree = torch.zeros(len(specs), dtype=torch.bool)
    for s, (_, parents, _) in enumerate(specs):
        if parents is not None:
            tree_mask[qsl[s] : qsl[s + 1]] = tree_mask_from_parents(parents)
            is_tree[s] = True
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        scale=head_dim**-0.5,
        tree_mask=tree_mask,
        is_tree=is_tree,
    )


def _ancestors_or_self(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def _naive(batch, specs):
    """Per-query softmax over an explicit key list built from the parent arrays."""
    q, k_cache, v_cache = batch["q"].float(), batch["k_cache"].float(), batch["v_cache"].float()
    qpk = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    qsl = batch["query_start_loc"].tolist()
    for s, (ctx, parents, q_len) in enumerate(specs):
        for i in range(q_len):
            new = _ancestors_or_self(parents, i) if parents is not None else range(i + 1)
            pos = torch.tensor(list(range(ctx)) + [ctx + j for j in new])
            blk = batch["block_table"][s, pos // BLOCK_SIZE].long()
            k = k_cache[blk, pos % BLOCK_SIZE].repeat_interleave(qpk, dim=1)
            v = v_cache[blk, pos % BLOCK_SIZE].repeat_interleave(qpk, dim=1)
            row = q[qsl[s] + i]
            p = torch.softmax(torch.einsum("hd,khd->hk", row, k) * batch["scale"], dim=-1)
            out[qsl[s] + i] = torch.einsum("hk,khd->hd", p, v)
    return out


def test_bitmask_helpers():
    rng = random.Random(1)
    for n in (1, 5, 33, 64):
        parents = _random_parents(n, rng)
        dense = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            dense[i, _ancestors_or_self(parents, i)] = True
        assert torch.equal(pack_tree_mask(dense), tree_mask_from_parents(parents))
    assert tree_mask_from_parents(list(range(-1, 63)))[63] == -1  # all 64 bits set
    with pytest.raises(ValueError):
        tree_mask_from_parents([-1, 2, 0])


def test_reference_matches_parent_walk():
    specs = _tree_specs(random.Random(0))
    batch = _make_batch(specs, head_dim=32, qpk=4, dtype=torch.float32)
    torch.testing.assert_close(tree_attention_ref(**batch), _naive(batch, specs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "qpk,head_dim,dtype",
    [
        (1, 64, torch.float32),
        (1, 32, torch.float32),
        (4, 64, torch.float32),
        (4, 32, torch.float32),
        (1, 32, torch.float16),
        (4, 64, torch.float16),
    ],
)
def test_matches_reference(qpk, head_dim, dtype):
    specs = _tree_specs(random.Random(qpk * 100 + head_dim))
    batch = _make_batch(specs, head_dim, qpk, dtype, seed=head_dim + qpk)
    got = tree_attention_triton(**batch)
    want = tree_attention_ref(**batch)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_max_tree_and_odd_head_dim():
    """64-node tree (bit 63 = int64 sign bit), head_dim 48 (padded to 64),
    GQA 3 (rows padded to a power of two), tiles equal to cache blocks."""
    specs = [
        (19, _random_parents(64, random.Random(7)), 64),
        (5, list(range(-1, 63)), 64),  # chain: the last query sees all 64 bits
        (40, None, 3),
    ]
    batch = _make_batch(specs, head_dim=48, qpk=3, dtype=torch.float32, seed=3)
    got = tree_attention_triton(**batch, block_n=16)
    torch.testing.assert_close(got, tree_attention_ref(**batch), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, _naive(batch, specs), atol=1e-4, rtol=1e-4)


def test_mask_defaults():
    """tree_mask=None -> all causal; is_tree=None -> every sequence is a tree."""
    rng = random.Random(5)
    causal = [(17, None, 6), (0, None, 9)]
    batch = _make_batch(causal, head_dim=32, qpk=2, dtype=torch.float32, seed=5)
    batch.update(tree_mask=None, is_tree=None)
    torch.testing.assert_close(tree_attention_triton(**batch), _naive(batch, causal), atol=1e-4, rtol=1e-4)

    trees = [(33, _random_parents(9, rng), 9), (2, _random_parents(4, rng), 4)]
    batch = _make_batch(trees, head_dim=32, qpk=2, dtype=torch.float32, seed=6)
    batch.update(is_tree=None)
    torch.testing.assert_close(tree_attention_triton(**batch), _naive(batch, trees), atol=1e-4, rtol=1e-4)
    # The dispatcher takes the kernel here because it is interpreted.
    torch.testing.assert_close(tree_attention(**batch), _naive(batch, trees), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_segments", [2, 3, 7])
def test_split_kv_matches_reference(num_segments):
    """Context slices merged by log-sum-exp: the same rows as one pass, for
    contexts shorter than the number of slices (empty slices), spanning
    several tiles per slice, and with no context at all; padding rows past
    the last query stay unwritten."""
    specs = _tree_specs(random.Random(9)) + [(150, _random_parents(12, random.Random(4)), 12)]
    batch = _make_batch(specs, head_dim=32, qpk=4, dtype=torch.float32, seed=11)
    n = batch["q"].shape[0]
    batch["q"] = torch.cat([batch["q"], torch.zeros_like(batch["q"][:3])])  # padded rows
    out = torch.full_like(batch["q"], 7.0)
    got = tree_attention_triton(**batch, out=out, block_n=16, num_segments=num_segments)
    want = tree_attention_ref(**{**batch, "q": batch["q"][:n]})
    torch.testing.assert_close(got[:n], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[n:], torch.full_like(got[n:], 7.0))


def test_split_kv_segments_choice():
    from vllm_specplug.kernels.tree_attention import split_kv_segments

    assert split_kv_segments(300, 4) == 1  # short context: no split
    assert split_kv_segments(100_000, 512) == 1  # the grid is already full
    assert split_kv_segments(4096, 16) == 8  # 4096 // 512 slices of 512 keys
    assert split_kv_segments(2048, 16) == 4
    assert split_kv_segments(100_000, 8) == 8  # at most MAX_SEGMENTS
    assert split_kv_segments(100_000, 100) == 3  # brings 100 programs near 256


@pytest.mark.parametrize("block_q,block_n", [(1, 16), (3, 32), (16, 64), (32, 16)])
def test_any_tile_size_matches_reference(block_q, block_n):
    """The tile sizes are tuning only: query tokens per program (a tree or a
    causal run cut anywhere, or many in one tile) and keys per tile."""
    specs = _tree_specs(random.Random(5))
    batch = _make_batch(specs, head_dim=32, qpk=2, dtype=torch.float32, seed=6)
    want = tree_attention_ref(**batch)
    for segments in (1, 3):
        got = tree_attention_triton(**batch, block_q=block_q, block_n=block_n,
                                    num_segments=segments)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_tile_choice():
    from vllm_specplug.kernels.tree_attention import tile_keys, tile_rows

    assert tile_rows(128) == 64 and tile_rows(256) == 32
    # a key row of at most 256 bytes gets 64 keys a tile
    assert tile_keys(128, 2) == 64 and tile_keys(64, 4) == 64
    assert tile_keys(128, 4) == 32 and tile_keys(256, 2) == 32
