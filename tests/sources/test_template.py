"""TreeTemplate: shapes, prefixes, batched expansion, conversion to DraftTree."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_specplug.sources.adjacency import UNTOUCHED, AdjacencyTable
from vllm_specplug.sources.template import PRESETS, RANK_PRIOR, TreeTemplate, parse_level_counts


def _score(path) -> float:
    return math.prod(RANK_PRIOR[r] for r in path)


def _naive_expand(tpl: TreeTemplate, table: torch.Tensor, root: int) -> list[int]:
    """Node by node, straight from the definition."""
    vocab = table.shape[0]
    out: list[int] = []
    for p, r in zip(tpl.parents, tpl.ranks):
        parent_tok = root if p < 0 else out[p]
        out.append(int(table[parent_tok, r]) if 0 <= parent_tok < vocab else -1)
    return out


def _random_table(vocab: int, k: int, seed: int, untouched: float = 0.3) -> AdjacencyTable:
    g = torch.Generator().manual_seed(seed)
    t = AdjacencyTable(vocab, k)
    filled = torch.nonzero(torch.rand(vocab, generator=g) >= untouched).flatten()
    rows = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(len(filled))])
    t.update(filled, rows)
    return t


def test_default_template_shape():
    t = TreeTemplate.from_spec("default")
    assert len(t) == 80 and t.depth == 9
    assert t.level_sizes() == [8, 16, 14, 11, 8, 7, 6, 5, 5]  # Graft Table 7 envelope
    assert 60 <= len(t) <= 80 and 6 <= t.depth <= 9


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_follow_their_level_counts(name):
    t = TreeTemplate.from_spec(name)
    assert t.level_sizes() == list(PRESETS[name])
    assert len(t) == sum(PRESETS[name])


def test_order_is_topological_and_best_first():
    t = TreeTemplate.from_spec("default")
    paths = t.rank_paths()
    scores = [_score(p) for p in paths]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(scores, scores[1:]))
    for i, p in enumerate(t.parents):
        assert -1 <= p < i
    assert len(set(paths)) == len(paths)
    assert t.max_rank == 7


def test_high_ranks_get_more_descendants_and_depth():
    t = TreeTemplate.from_spec("default")
    paths = t.rank_paths()
    subtree = [sum(1 for p in paths if p[0] == r) for r in range(8)]
    deepest = [max(len(p) for p in paths if p[0] == r) for r in range(8)]
    assert subtree == sorted(subtree, reverse=True) and subtree[0] > subtree[1] > subtree[7]
    assert deepest == sorted(deepest, reverse=True) and deepest[0] == 9
    assert t.greedy_chain() == [paths.index((0,) * d) for d in range(1, 10)]


@pytest.mark.parametrize("name", ["default", "tr"])
def test_every_cut_is_a_valid_prefix(name):
    t = TreeTemplate.from_spec(name)
    for n in range(len(t) + 2):
        c = t.cut(n)
        assert len(c) == min(n, len(t))
        assert c.parents == t.parents[: len(c)] and c.ranks == t.ranks[: len(c)]
        assert c.rank_paths() == t.rank_paths()[: len(c)]


def test_level_counts_clip_to_k_and_custom_specs():
    t = TreeTemplate.from_spec("default", k=4)
    assert t.level_sizes()[0] == 4 and t.max_rank <= 3
    assert TreeTemplate.from_spec("3,2,1").level_sizes() == [3, 2, 1]
    assert TreeTemplate.from_spec(" 1,1,1 ").rank_paths() == [(0,), (0, 0), (0, 0, 0)]
    for bad in ("nope", "3,,1", "3,0", ""):
        with pytest.raises(ValueError):
            parse_level_counts(bad)


def test_invalid_templates_rejected():
    with pytest.raises(ValueError):
        TreeTemplate([0], [0])  # parent after child
    with pytest.raises(ValueError):
        TreeTemplate([-1, -1], [0, 0])  # repeated rank
    with pytest.raises(ValueError):
        TreeTemplate.from_rank_paths([[0, 0], [0]])  # parent after child
    with pytest.raises(ValueError):
        TreeTemplate.from_spec("default", k=8).expand(AdjacencyTable(10, 4), torch.tensor([1]))


@pytest.mark.parametrize("name", ["default", "tr", "graft_d5"])
def test_expand_matches_naive_reference(name):
    vocab, k = 64, 8
    tpl = TreeTemplate.from_spec(name)
    table = _random_table(vocab, k, seed=1)
    roots = torch.tensor([0, 5, 17, 63, -1, 64, 33, 2])  # incl. out-of-vocab roots
    out = tpl.expand(table, roots)
    assert out.shape == (8, len(tpl)) and out.dtype == torch.long
    for b, root in enumerate(roots.tolist()):
        assert out[b].tolist() == _naive_expand(tpl, table.table, root)
    assert int((out == UNTOUCHED).sum()) > 0  # untouched rows were hit


def test_expand_accepts_raw_tensor_and_empty_batch():
    tpl = TreeTemplate.from_spec("3,2")
    table = _random_table(20, 8, seed=2, untouched=0.0)
    root = torch.tensor([4])
    assert torch.equal(tpl.expand(table.table, root), tpl.expand(table, root))
    assert tpl.expand(table, torch.empty(0, dtype=torch.long)).shape == (0, 5)


def test_expand_matches_kernel_reference():
    adj = pytest.importorskip("vllm_specplug.kernels.adjacency")
    tpl = TreeTemplate.from_spec("default")
    table = _random_table(128, 8, seed=3)
    roots = torch.randint(-1, 129, (16,), generator=torch.Generator().manual_seed(0))
    parent_idx = torch.tensor(tpl.parents, dtype=torch.int32)
    rank = torch.tensor(tpl.ranks, dtype=torch.int32)
    ref = adj.template_expand_ref(table.table, roots, parent_idx, rank)
    assert adj.template_depth(parent_idx) == tpl.depth
    assert torch.equal(tpl.expand(table, roots), ref.long())


def test_to_draft_tree_drops_dead_nodes_and_their_subtrees():
    # root -> a [0], b [1]; a -> c [0,0]; b -> d [1,0]
    tpl = TreeTemplate.from_rank_paths([[0], [1], [0, 0], [1, 0]])
    tree = tpl.to_draft_tree([10, -1, 12, 13])
    assert tree.tokens == [10, 12] and tree.parents == [-1, 0]
    tree = tpl.to_draft_tree([-1, 11, 12, 13])
    assert tree.tokens == [11, 13] and tree.parents == [-1, 0]
    assert len(tpl.to_draft_tree([-1, -1, 5, 5])) == 0


def test_to_draft_tree_dedupes_siblings_and_fills_budget():
    tpl = TreeTemplate.from_rank_paths([[0], [1], [0, 0], [1, 0], [2]])
    tree = tpl.to_draft_tree([7, 7, 8, 9, 6])
    # The second 7 and its subtree go; node [2] takes a freed slot.
    assert tree.tokens == [7, 8, 6] and tree.parents == [-1, 0, -1]
    assert tpl.to_draft_tree([7, 7, 8, 9, 6], max_nodes=2).tokens == [7, 8]
    assert len(tpl.to_draft_tree([7, 7, 8, 9, 6], max_nodes=0)) == 0


def test_to_draft_tree_of_real_expansion_is_valid():
    tpl = TreeTemplate.from_spec("default")
    table = _random_table(50, 8, seed=4, untouched=0.2)
    rows = tpl.expand(table, torch.arange(50)).tolist()
    for row in rows:
        for budget in (1, 7, 63, 80):
            tree = tpl.to_draft_tree(row, budget)
            tree.validate()
            assert len(tree) <= budget and -1 not in tree.tokens
            kids = tree.children()
            for ch in kids:
                toks = [tree.tokens[c] for c in ch]
                assert len(toks) == len(set(toks))


def test_chain_tokens():
    tpl = TreeTemplate.from_spec("default")
    table = AdjacencyTable(10, 8)
    table.update(torch.tensor([1, 2, 3]), torch.tensor([[2] * 8, [3] * 8, [9] * 8]))
    row = tpl.expand(table, torch.tensor([1]))[0].tolist()
    assert tpl.chain_tokens(row) == [2, 3, 9]  # row 9 is untouched: stop
    assert tpl.chain_tokens(row, 2) == [2, 3]


def test_measured_presets_are_best_first_and_prefix_closed():
    from vllm_specplug.methods.recycle import RecycleConfig, auto_template
    from vllm_specplug.sources.template import MEASURED

    for name, n in (("m8", 8), ("m16", 16)):
        t = TreeTemplate.from_spec(name)
        assert len(t) == n and t.scores is not None
        assert list(t.scores) == sorted(t.scores, reverse=True)  # best first
        for i, p in enumerate(t.parents):  # a child never outscores its parent
            assert p < 0 or t.scores[p] >= t.scores[i]
        assert len(MEASURED[name]) == n
    assert TreeTemplate.from_spec("m16").rank_paths()[:8] == TreeTemplate.from_spec("m8").rank_paths()
    assert len(TreeTemplate.from_spec("m8", k=2)) == 7  # rank 2 dropped
    assert [auto_template(n) for n in (1, 8, 9, 16, 17)] == ["m8", "m8", "m16", "m16", "default"]
    assert len(RecycleConfig().build_template(8)) == 8
    assert len(RecycleConfig().build_template(24)) == 80
    # the draft tree carries the template's scores
    tree = TreeTemplate.from_spec("m8").to_draft_tree(list(range(100, 108)), 4)
    assert tree.scores == list(TreeTemplate.from_spec("m8").scores[:4])


def test_template_file_with_ranks_past_topk_is_a_start_up_error(tmp_path):
    """A template file (as `specplug reader optimize-tree` writes it) whose
    ranks reach past the drafter's top-k is refused when the options are
    checked, naming the key, for every method that loads templates."""
    import json

    from vllm_specplug.config import SpecplugConfigError
    from vllm_specplug.registry import build_config

    path = tmp_path / "wide.json"
    path.write_text(json.dumps({"rank_paths": [[0], [5], [0, 0]]}))
    assert len(TreeTemplate.from_spec(str(path), 8)) == 3
    with pytest.raises(ValueError, match="uses rank 5, but topk=4"):
        TreeTemplate.from_spec(str(path), 4)
    cases = [("recycle", {"template": str(path), "topk": 4}, "template"),
             ("eagle3_tree", {"mode": "static", "template": str(path), "topk": 4}, "template"),
             ("graft", {"templates": [str(path)] * 3, "adjacency_topk": 4}, "templates")]
    for method, options, key in cases:
        with pytest.raises(SpecplugConfigError, match=f"{key}.*uses rank 5"):
            build_config(method, options, 3)
        build_config(method, {**options, **{k: 8 for k in options if "topk" in k}}, 3)
