"""`auto` without an engine: when a request asks the head, the cheap
sources' expected tokens and the datastore source's path. Expected values
are worked by hand."""

from __future__ import annotations

import numpy as np

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.methods.auto import _HeadUse


def _req(token_seconds: float, rid: str = "r") -> StepRequest:
    return StepRequest(req_id=rid, token_ids=np.arange(5), num_prompt_tokens=3, sampled=True,
                       verified_pos=4, token_seconds=token_seconds, budget=8)


def test_the_head_is_asked_while_unmeasured():
    use = _HeadUse(explore_every=4)
    assert use.asks(_req(0.0))  # no step time measured yet
    assert use.asks(_req(0.01))  # no head time measured yet


def test_a_request_whose_head_adds_nothing_stops_asking_and_explores():
    use = _HeadUse(explore_every=4, weight=4.0, decay=1.0)
    use.cost(0.004, 1)  # 4 ms of head per request asking
    for _ in range(40):
        use.observe("r", 0)  # the head added no accepted node
    # 0 accepted per step against 4 ms: a token saving 10 ms does not pay it
    asked = [use.asks(_req(0.010)) for _ in range(8)]
    assert asked == [False, False, False, True] * 2  # every 4th step explores


def test_one_slow_head_call_does_not_price_the_head_out():
    """A first call measured while another process held the cores (250 ms
    where the head costs 5): the next usual call brings the estimate half
    the way down at once, and a request whose head adds one accepted token
    a step (10 ms saved) asks again within a few calls. A dearer call
    counts at most twice the estimate."""
    use = _HeadUse(explore_every=100, weight=4.0, decay=1.0)  # no exploring here
    for _ in range(40):
        use.observe("r", 1)
    use.cost(0.250, 1)
    assert not use.asks(_req(0.010))
    calls = 0
    while not use.asks(_req(0.010)):
        use.cost(0.005, 1)
        calls += 1
    # 250 -> 127.5 -> 66.3 -> 35.6 -> 20.3 -> 12.7 -> 8.8 ms: below what
    # the head's token a step saves (10 ms x 0.999 accepted a step)
    assert calls == 6
    assert abs(use.seconds - 0.008828125) < 1e-12
    use.cost(1.0, 1)  # a stall: counts as 2 x 8.8 ms, a tenth of the way
    assert abs(use.seconds - 0.008828125 * 1.1) < 1e-12


def test_a_request_whose_head_adds_tokens_keeps_asking():
    use = _HeadUse(explore_every=4, weight=4.0, decay=1.0)
    use.cost(0.004, 1)
    for _ in range(40):
        use.observe("r", 2)  # two accepted head nodes a step: 20 ms saved > 4 ms
    assert all(use.asks(_req(0.010)) for _ in range(8))
    # another request starts from all requests' record, which pays too
    assert use.asks(_req(0.010, "new"))


def test_cover_levels():
    from vllm_specplug.methods.auto import cover_of

    assert [cover_of(x) for x in (0.0, 0.49, 0.5, 1.99, 2.0, 7.0)] == [0, 0, 1, 1, 2, 2]


def test_the_head_is_judged_per_cover_level():
    """Beside a confident copy (level 2) the head added nothing; where
    nothing else drafted (level 0) it added one token a step: the same
    request stops asking at level 2 (exploring every 4th step) and keeps
    asking at level 0 (10 ms saved > 4 ms)."""
    use = _HeadUse(explore_every=4, weight=4.0, decay=1.0)
    use.cost(0.004, 1)
    for _ in range(40):
        use.observe("r", 0, cover=2)
        use.observe("r", 1, cover=0)
    assert [use.asks(_req(0.010), 2) for _ in range(4)] == [False, False, False, True]
    assert all(use.asks(_req(0.010), 0) for _ in range(4))
    # a level never seen starts from the prior, half a token a step: 5 ms > 4 ms
    assert use.asks(_req(0.010), 1)


def test_expected_tokens_of_the_cheap_sources():
    """A copy chain claimed 0.8, 0.6, 0.3 from the root and a suffix node
    claimed 0.5 (another first token); no evidence yet, so every factor is
    1: the chances are the claims, and the ``budget`` likeliest count."""
    from vllm_specplug.engine.tree import DraftTree
    from vllm_specplug.sources.source_mix import SourceMix

    copy = DraftTree([5, 6, 7], [-1, 0, 1], scores=[0.8, 0.6, 0.3])
    suffix = DraftTree([9], [-1], scores=[0.5])
    mix = SourceMix()
    drafts = [("copy4", copy), ("suffix", suffix)]
    assert abs(mix.expected("r", drafts, 8) - 2.2) < 1e-9
    assert abs(mix.expected("r", drafts, 3) - 1.9) < 1e-9  # 0.8 + 0.6 + 0.5
    assert mix.expected("r", [], 8) == 0.0
    assert mix.merge("r", drafts, 8, 10) is not None  # expected() left nothing to judge before


def test_rows_to_feed_count_in_the_cost_of_asking():
    """4 ms of head a step, 0.2 ms a row fed, spread over 16 steps; the
    head adds one accepted token a step, worth 10 ms. Nothing to feed:
    10 ms >= 4 ms, it asks. An 800-row prompt to feed first: 4 + 160 / 16 =
    14 ms > 10 ms, it does not, and explores only once the steps not asked
    saved the feed (160 ms = 40 steps of 4 ms), not every 4th step."""
    use = _HeadUse(explore_every=4, weight=4.0, decay=1.0, feed_steps=16)
    use.cost(0.004, 1)
    use.feed(0.002, 10)  # 0.2 ms a row
    for _ in range(40):
        use.observe("r", 1)
    assert use.asks(_req(0.010), pending=0)
    asked = [use.asks(_req(0.010), pending=800) for _ in range(40)]
    assert asked == [False] * 39 + [True]
    # a short prompt costs little: 4 + 40 x 0.2 / 16 = 4.5 ms < 10 ms
    assert use.asks(_req(0.010, "short"), pending=40)


def test_feeding_is_timed_per_row_like_the_head_calls():
    use = _HeadUse(explore_every=4)
    use.feed(0.0, 0)  # nothing fed: nothing learned
    assert use.row_seconds is None
    use.feed(0.010, 50)
    assert abs(use.row_seconds - 0.0002) < 1e-12
    use.feed(1.0, 10)  # a stall counts at most twice the estimate, a tenth of the way
    assert abs(use.row_seconds - 0.0002 * 1.1) < 1e-12


def test_the_datastore_source_drafts_the_stores_path(tiny_model):
    """A store of two documents, ``1 2 3 4 5 6 7`` and ``1 2 3 4 5 9``; the
    request ends ``2 3 4``. Both documents continue it with 5 (share 1);
    after ``2 3 4 5`` come 6 and 9 once each (the tie goes to the smaller
    id: 6, share 1/2); after ``3 4 5 6`` comes 7 (share 1); nothing
    follows ``4 5 6 7`` or any suffix of it but a document's end. Claims
    multiply down the path: 1, 1/2, 1/2. A budget of 2 cuts the path."""
    from tests.helpers.contexts import proposer_ctx
    from vllm_specplug.methods.auto import AutoConfig, AutoProposer
    from vllm_specplug.sources.suffix_array import TokenSuffixArray

    auto = AutoProposer(AutoConfig(use_head="never", suffix=False),
                        proposer_ctx(tiny_model, 512, 64))
    assert auto.store is None  # no datastore configured: no source
    auto.store = TokenSuffixArray.from_documents([[1, 2, 3, 4, 5, 6, 7],
                                                  [1, 2, 3, 4, 5, 9]], 512)
    req = StepRequest(req_id="r", token_ids=np.array([10, 11, 2, 3, 4]), num_prompt_tokens=3,
                      sampled=True, verified_pos=4, budget=8)
    (name, tree), = auto._lookups(req)  # no repeat in the request: no copy
    assert name == "datastore"
    assert (tree.tokens, tree.parents, tree.scores) == ([5, 6, 7], [-1, 0, 1], [1.0, 0.5, 0.5])
    (_, tree), = auto._lookups(StepRequest(**{**req.__dict__, "budget": 2}))
    assert tree.tokens == [5, 6]
    assert auto.stats().counters["datastore_drafts"] == 2


def test_steps_no_request_drafts_in_feed_the_suffix_trees_later(tiny_model):
    """Gate-closed steps (every budget 0) hold the new tokens; the next step
    in which a request drafts feeds them first, so its suffix draft is the
    draft of trees fed every step."""
    import pytest

    from tests.helpers.contexts import proposer_ctx
    from vllm_specplug.methods.auto import AutoConfig, AutoProposer
    from vllm_specplug.sources import suffix_cache

    if not suffix_cache.available():
        pytest.skip("arctic-inference is not installed")
    auto = AutoProposer(AutoConfig(use_head="never", prompt_lookup_max=1),
                        proposer_ctx(tiny_model, 512, 64))
    every = suffix_cache.TenantSuffixCaches(max_cached_requests=0)
    tokens = np.array([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6])

    def step(n, budget):
        return StepRequest(req_id="r", token_ids=tokens[:n], num_prompt_tokens=4,
                           sampled=True, verified_pos=n - 1, budget=budget)

    for n in range(5, len(tokens)):
        assert auto.propose([step(n, 0)]) == [None]
        every.sync("r", None, tokens[:n], 4)
    assert "r" in auto.suffix._held  # fed nothing since its first step
    every.sync("r", None, tokens, 4)
    auto.propose([step(len(tokens), 8)])
    assert "r" not in auto.suffix._held
    mine = auto.suffix.draft("r", tokens, 8)
    ref = every.draft("r", tokens, 8)
    assert ref is not None and (mine.tokens, mine.parents, mine.scores) == \
        (ref.tokens, ref.parents, ref.scores)
