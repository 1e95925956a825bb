"""READER's tree-shape optimiser (Appendix E, Theorem 1) on synthetic
acceptance profiles and cost curves whose optimum is worked out by hand,
and template files round-tripping into the methods' option checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources.template import TreeTemplate, load_template_file, parse_level_counts
from vllm_specplug.sources.tree_acceptance import tree_rank_paths
from vllm_specplug.sources.tree_shape import (CostCurve, choose_shape, node_acceptance,
                                              prune_order, save_template)

# a chain 0-1-2-3-4-5 (ranks 0) and two more root children (ranks 1, 2)
SEED = TreeTemplate.from_rank_paths([[0], [1], [2], [0, 0], [0, 0, 0], [0, 0, 0, 0],
                                     [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
ALPHA = [0.9, 0.05, 0.04, 0.8, 0.7, 0.3, 0.2, 0.1]


def test_prunes_lowest_acceptance_leaves_first():
    # leaves: rank-2 child (0.04), rank-1 (0.05), then the chain from its tip
    assert prune_order(SEED, ALPHA) == [2, 1, 7, 6, 5, 4, 3, 0]


def test_linear_cost_finds_the_hand_computed_optimum():
    """T(n) = 1 + 0.1 n. Tokens per unit time by size (1 + sum alpha)/T:
    8: 4.09/1.8=2.27, 7: 4.05/1.7=2.38, 6: 4.0/1.6=2.50, 5: 3.9/1.5=2.60,
    4: 3.7/1.4=2.643, 3: 3.4/1.3=2.615, 2: 2.7/1.2=2.25, 1: 1.9/1.1=1.73:
    the optimum keeps the chain's first 4 nodes."""
    cost = CostCurve([0, 8], [1.0, 1.8])
    choice = choose_shape(SEED, ALPHA, cost)
    assert choice.size == 4
    assert choice.template.rank_paths() == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    assert choice.expected_tokens == pytest.approx(3.7)
    rates = {p["size"]: p["tokens_per_ms"] for p in choice.curve}
    assert rates[4] == pytest.approx(3.7 / 1.4) and max(rates, key=rates.get) == 4


def test_the_cost_curve_decides_flat_keeps_all_steep_keeps_one():
    flat = choose_shape(SEED, ALPHA, CostCurve([0, 64], [1.0, 1.0]))  # GPU-like
    assert flat.size == 8
    steep = choose_shape(SEED, ALPHA, CostCurve([0, 1, 8], [1.0, 1.2, 20.0]))
    assert steep.size == 1 and steep.template.rank_paths() == [(0,)]
    # extra rows (reader's search paths) are costed: a fixed overhead makes
    # one more node relatively cheaper, T = 1.8 + 0.1 n: 6: 4.0/2.4=1.667,
    # 5: 3.9/2.3=1.696, 4: 3.7/2.2=1.682
    extra = choose_shape(SEED, ALPHA, CostCurve([0, 8], [1.0, 1.8]), extra_nodes=8)
    assert extra.size == 5


def test_curve_interpolates_and_extrapolates(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"records": [
        {"batch_size": 1, "tree_size": 0, "step_ms": 10.0},
        {"batch_size": 1, "tree_size": 4, "step_ms": 14.0},
        {"batch_size": 1, "tree_size": 8, "step_ms": 22.0},
        {"batch_size": 8, "tree_size": 0, "step_ms": 99.0}]}))
    c = CostCurve.from_verify_cost(str(path), 1)
    assert c(2) == pytest.approx(12.0) and c(12) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="batch size 8"):
        CostCurve.from_verify_cost(str(path), 8)


def test_acceptance_from_accepted_paths_and_tree_ranks():
    steps = 10
    paths = [(0, 0, 0)] * 5 + [(1,)] * 2 + [()] * 3
    alpha = node_acceptance(SEED, steps, paths)
    assert alpha.tolist() == [0.5, 0.2, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    # a drafted tree laid out best child first: sibling index -> rank
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, -1])
    assert tree_rank_paths(tree, SEED) == [(0,), (0, 0), (1,), (2,)]


def test_template_file_round_trip_and_errors(tmp_path):
    choice = choose_shape(SEED, ALPHA, CostCurve([0, 8], [1.0, 1.8]))
    out = tmp_path / "t.json"
    save_template(str(out), choice.template, {"batch_size": 1})
    t = load_template_file(str(out))
    assert t.rank_paths() == choice.template.rank_paths()
    assert TreeTemplate.from_spec(str(out)).rank_paths() == t.rank_paths()
    assert parse_level_counts(str(out)) == (1, 1, 1, 1)
    # every prefix is a tree (best first)
    assert all(p[:-1] in t.rank_paths()[:i] or len(p) == 1
               for i, p in enumerate(t.rank_paths()))
    # the methods' option checks accept it, and name a bad file in one line
    from vllm_specplug.config import SpecplugConfigError
    from vllm_specplug.registry import resolve

    resolve({"method": "eagle3_tree", "num_speculative_tokens": 4, "mode": "static",
             "template": str(out)})
    resolve({"method": "recycle", "num_speculative_tokens": 4, "template": str(out)})
    with pytest.raises(SpecplugConfigError, match="not found"):
        resolve({"method": "reader", "num_speculative_tokens": 16,
                 "template": str(tmp_path / "missing.json")})
    (tmp_path / "bad.json").write_text('{"rank_paths": [[0, 0]]}')
    with pytest.raises(SpecplugConfigError, match="before its parent"):
        resolve({"method": "recycle", "num_speculative_tokens": 4,
                 "template": str(tmp_path / "bad.json")})
    assert np.isfinite(choice.step_ms)
