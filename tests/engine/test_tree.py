"""DraftTree, normalize_tree and TrieBuilder: the shape every method returns."""

from __future__ import annotations

import random

from vllm_specplug.engine.tree import DraftTree, TrieBuilder, normalize_tree


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path (the tree's meaning, order aside)."""
    out = set()
    for n in range(len(tree)):
        path = []
        while n >= 0:
            path.append(tree.tokens[n])
            n = tree.parents[n]
        out.add(tuple(reversed(path)))
    return out


def test_follow_returns_deepest_node_and_depth():
    #   -1 -> 0:a(5) -> 1:b(6) -> 3:d(8)
    #      -> 2:c(7)
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1])
    assert tree.follow([5, 6, 8, 9]) == (3, 3)
    assert tree.follow([7, 1]) == (2, 1)
    assert tree.follow([9]) == (-1, 0)
    assert tree.follow([]) == (-1, 0)


def test_normalize_unifies_duplicate_siblings_keeping_their_subtrees():
    # Model drafts 5 -> 6; retrieval drafts 5 -> 9 -> 10 as a duplicate 5.
    tree = DraftTree([5, 6, 5, 9, 10], [-1, 0, -1, 2, 3],
                     sources=["model", "model", "retrieval", "retrieval", "retrieval"])
    out = normalize_tree(tree, 8)
    out.validate()
    assert _paths(out) == {(5,), (5, 6), (5, 9), (5, 9, 10)}
    assert len(out) == 4
    assert out.sources == ["model", "model", "retrieval", "retrieval"]


def test_normalize_cuts_a_prefix_without_scores_best_first_with_them():
    tree = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2])
    assert normalize_tree(tree, 2).tokens == [1, 2]
    scored = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2], scores=[-1.0, -5.0, -0.5, -0.7])
    out = normalize_tree(scored, 3)
    # 3 (-0.5), then its child 4 (-0.7), then 1 (-1.0); 2 (-5.0) is cut.
    assert out.tokens == [1, 3, 4] and out.parents == [-1, -1, 1]
    assert out.scores == [-1.0, -0.5, -0.7]


def test_normalize_drops_invalid_parents_and_keeps_order():
    tree = DraftTree([1, 2, 3], [-1, 5, 0])  # node 1's parent does not exist
    out = normalize_tree(tree, 8)
    assert out.tokens == [1, 3] and out.parents == [-1, 0]


def test_normalize_random_trees_keep_every_path_once():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 20)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        tokens = [rng.randint(0, 3) for _ in range(n)]
        tree = DraftTree(tokens, parents)
        out = normalize_tree(tree, 100)
        out.validate()
        assert _paths(out) == _paths(tree)
        assert len(out) == len(_paths(tree))  # no duplicate siblings


def test_trie_insert_tree_merges_onto_existing_nodes_best_first():
    trie = TrieBuilder(4)
    trie.insert([5, 6], source="model")
    added = trie.insert_tree(DraftTree([5, 9, 7, 8], [-1, 0, -1, 2],
                                       scores=[0.0, -1.0, -0.1, -3.0],
                                       sources=["r"] * 4))
    # 5 is shared; then 7 (-0.1), 9 (-1.0) fill the budget; 8 does not fit.
    assert added == 2
    tree = trie.build()
    assert _paths(tree) == {(5,), (5, 6), (5, 9), (7,)}
    assert tree.tokens[:2] == [5, 6]  # first inserted first
    assert tree.sources[:2] == ["model", "model"]
    assert _paths(TrieBuilder.from_tree(tree, 10).build()) == _paths(tree)


def test_metadata_survives_truncation_and_first_path():
    tree = DraftTree([1, 2, 3], [-1, 0, -1], scores=[0.1, 0.2, 0.3], sources=["a", "b", "c"])
    assert tree.truncated(2).sources == ["a", "b"]
    assert tree.first_path().scores == [0.1, 0.2]
