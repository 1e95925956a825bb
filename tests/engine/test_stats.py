"""TreeStats' per-source counts."""

from vllm_specplug.engine.stats import TreeStats
from vllm_specplug.engine.tree import DraftTree


def test_accepted_tokens_are_counted_per_source_along_the_accepted_path():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 1, -1], sources=["model", "model", "ret", "ret"])
    s = TreeStats()
    s.record_sources(tree, [5, 6, 7])
    s.record_sources(tree.truncated(1), [5, 6])  # the scheduler kept one node
    s.record_sources(tree, [9])
    assert s.source_accepted == {"model": 3, "ret": 1}
    assert s.source_nodes == {"model": 2 + 1 + 2, "ret": 4}
    assert s.as_dict()["source_accepted"] is not s.source_accepted
