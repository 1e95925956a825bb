"""`auto` without an engine: when a request asks the head, and the copy
source's tree. Expected values are worked by hand."""

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


def test_a_request_whose_head_adds_tokens_keeps_asking():
    use = _HeadUse(explore_every=4, weight=4.0, decay=1.0)
    use.cost(0.004, 1)
    for _ in range(40):
        use.observe("r", 2)  # two accepted head nodes a step: 20 ms saved > 4 ms
    assert all(use.asks(_req(0.010)) for _ in range(8))
    # another request starts from all requests' record, which pays too
    assert use.asks(_req(0.010, "new"))
