"""The suffix-tree source: drafts from the real Arctic Inference suffix
trees, converted to DraftTrees, and the request bookkeeping (sync, stop,
preemption, the global tree across requests)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.sources import suffix_cache
from vllm_specplug.sources.suffix_cache import SuffixCache, match_source, to_draft_tree

pytestmark = pytest.mark.skipif(not suffix_cache.available(),
                                reason="arctic-inference is not installed")


def _ids(*xs):
    return np.asarray(xs, dtype=np.int64)


def test_sources_name_match_length_bucket_and_forks():
    # node 0 continues the match for sure; 1 and 2 are two continuations of
    # node 0 seen 3:1; 3 continues node 1 without a fork
    tree = to_draft_tree([5, 6, 7, 8], [-1, 0, 0, 1], [1.0, 0.75, 0.25, 0.75], match_len=3)
    tree.validate()
    assert tree.tokens == [5, 6, 7, 8] and tree.parents == [-1, 0, 0, 1]
    assert tree.sources == ["m2", "m2f", "m2f", "m2"]
    assert tree.scores == [1.0, 0.75, 0.25, 0.75]
    assert [match_source(n, False) for n in (1, 2, 3, 4, 7, 8, 30)] == \
        ["m1", "m2", "m2", "m4", "m4", "m8", "m8"]


def test_draft_follows_the_counts_of_the_context():
    # "1 2 3" occurs four times: followed by 4 twice (then 10, 12), by 5
    # once (then 11), and once at the end of the context, after a 7 that
    # makes no longer suffix of the context match anywhere
    prompt = _ids(1, 2, 3, 4, 10, 1, 2, 3, 5, 11, 1, 2, 3, 4, 12)
    c = SuffixCache(max_cached_requests=0)
    tokens = np.concatenate([prompt, _ids(7, 1, 2, 3)])  # output so far
    c.sync("a", tokens, len(prompt))
    tree = c.draft("a", tokens, 8, max_spec_factor=4.0, min_token_prob=0.2)
    assert tree is not None and len(tree) <= 8
    tree.validate()
    roots = {tree.tokens[i]: i for i, p in enumerate(tree.parents) if p < 0}
    assert sorted(roots) == [4, 5]
    assert tree.scores[roots[4]] == pytest.approx(2 / 4)
    assert tree.scores[roots[5]] == pytest.approx(1 / 4)
    kids = {t: sorted(tree.tokens[j] for j, p in enumerate(tree.parents) if p == i)
            for t, i in roots.items()}
    assert kids == {4: [10, 12], 5: [11]}
    # a 3-token match; a fork where other continuations were seen beside
    # the node (4 / 5, then 10 / 12), not after 5 (always 11)
    # (the first five nodes: depths 1 and 2, best first; deeper ones follow
    # each 10 / 12 / 11 with the one token seen after it)
    assert dict(zip(tree.tokens[:5], tree.sources[:5])) == {
        4: "m2f", 5: "m2f", 10: "m2f", 12: "m2f", 11: "m2"}
    assert tree.sources[5:] == ["m2"] * (len(tree) - 5)
    # one path only: the likelier continuation
    chain = c.draft("a", tokens, 8, tree=False, max_spec_factor=4.0, min_token_prob=0.2)
    assert chain.is_chain() and chain.tokens[0] == 4
    # nothing drafted without room, and nothing after an unseen token
    assert c.draft("a", tokens, 0) is None
    unseen = np.concatenate([tokens, _ids(77)])
    c.sync("a", unseen, len(prompt))
    assert c.draft("a", unseen, 8) is None


def test_sync_feeds_only_new_tokens_and_outputs_reach_later_requests():
    c = SuffixCache(max_cached_requests=16)
    a = _ids(10, 11, 12)
    c.sync("a", a, 3)
    out = np.concatenate([a, _ids(40, 41, 42, 43)])
    c.sync("a", out[:5], 3)
    c.sync("a", out, 3)
    c.sync("a", out, 3)  # nothing new: nothing fed twice
    assert c.active == 1 and c.cached == 1
    c.stop("a")
    assert c.active == 0 and c.cached == 1
    # a new request whose context ends with "40 41" drafts a's output
    b = _ids(20, 21, 40, 41)
    c.sync("b", b, 4)
    tree = c.draft("b", b, 4, max_spec_factor=2.0)
    assert tree is not None and tree.tokens[:2] == [42, 43]
    # a's output counted once: the continuation is certain, not 2:1 or 1:1
    assert tree.scores[0] == pytest.approx(1.0)

    # without the global tree the output stays with its request
    solo = SuffixCache(max_cached_requests=0)
    solo.sync("a", out, 3)
    solo.stop("a")
    solo.sync("b", b, 4)
    assert solo.draft("b", b, 4, max_spec_factor=2.0) is None


def test_a_preempted_request_comes_back_without_duplicating_its_output():
    c = SuffixCache(max_cached_requests=16)
    out = _ids(10, 11, 12, 40, 41, 42, 43)
    c.sync("a", out, 3)
    c.stop("a")  # preempted
    c.stop("a")  # a second notice is harmless
    c.sync("a", out, 3)  # recomputed: fed again from its prompt
    assert c.active == 1 and c.cached == 1
    more = np.concatenate([out, _ids(40, 41)])
    c.sync("a", more, 3)
    tree = c.draft("a", more, 2, max_spec_factor=2.0)
    # "40 41" twice in a's tokens, once followed by 42 43 and once at the
    # end: 1/2 (a stale second copy of a's first output would make it 2/3)
    assert tree.tokens == [42, 43] and tree.scores[0] == pytest.approx(1 / 2)


def test_held_tokens_reach_the_trees_at_the_next_sync_or_at_the_end():
    from vllm_specplug.sources.suffix_cache import TenantSuffixCaches

    prompt, out = _ids(10, 11, 12), _ids(40, 41, 42, 43)
    row = np.concatenate([prompt, out])  # the runner's row, reused later
    held = TenantSuffixCaches(max_cached_requests=16)
    held.hold("a", "t", row[:3], 3)  # a request not started: started at once
    assert held.active == 1
    for n in range(4, 8):
        held.hold("a", "t", row[:n], 3)
    row[3:] = 99  # another request takes the row: the held tokens were copied
    held.stop("a")  # what it held goes first: the whole response is cached
    b = _ids(20, 40, 41)
    held.sync("b", "t", b, 3)
    tree = held.draft("b", b, 2, max_spec_factor=2.0)
    assert tree is not None and tree.tokens == [42, 43]
    assert tree.scores[0] == pytest.approx(1.0)  # fed once, not twice
    assert held.cached_tokens == 4

    # held, then synced: the trees as if synced every step
    every, later = TenantSuffixCaches(max_cached_requests=0), \
        TenantSuffixCaches(max_cached_requests=0)
    tokens = _ids(5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6)
    for n in range(3, len(tokens) + 1):
        every.sync("a", None, tokens[:n], 3)
        (later.hold if n < len(tokens) else later.sync)("a", None, tokens[:n], 3)
    d1, d2 = (c.draft("a", tokens, 4, max_spec_factor=2.0) for c in (every, later))
    assert d1 is not None and (d1.tokens, d1.parents, d1.scores) == \
        (d2.tokens, d2.parents, d2.scores)
