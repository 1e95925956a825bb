"""`respec`'s retrieval side on hand-made histories and entropies (no
engine, no head): which entropies the trigger reads, the retrieval tree,
the EMA feedback from the next step, the ablation switches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.engine.interface import StepRequest
from vllm_specplug.methods.respec import RespecConfig, RespecProposer, _Req


def _proposer(**opts) -> RespecProposer:
    """The retrieval half only: the head is never asked here."""
    p = object.__new__(RespecProposer)
    p.config = RespecConfig(**opts)
    p.reqs = {}
    p.c = {k: 0 for k in ("steps", "triggered", "no_match", "filtered", "retrieved",
                          "fallback", "retrieval_verified", "retrieval_accepted",
                          "model_verified", "model_accepted")}
    return p


def _step(tokens, entropy, budget=8, draft_kept=0, n_prompt=4) -> StepRequest:
    return StepRequest(req_id="r", token_ids=np.asarray(tokens), num_prompt_tokens=n_prompt,
                       sampled=True, verified_pos=len(tokens) - 1 - len(entropy),
                       entropy=torch.tensor(entropy, dtype=torch.float32),
                       budget=budget, draft_kept=draft_kept)


def test_entropies_are_placed_at_the_rows_that_produced_the_tokens():
    st = _Req(RespecConfig())
    toks = list(range(10))
    st.record_entropy(_step(toks, [0.1, 0.2, 0.3]))
    # the last row (position 8) produced the newest token (position 9)
    assert np.isnan(st.entropy[5]) and st.entropy[6:9].tolist() == pytest.approx([0.1, 0.2, 0.3])
    # the trigger's window for key positions 7..9 is entropies 6..8
    assert st.recent_entropies(9, 3).tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert st.recent_entropies(9, 5).tolist() == pytest.approx([0.1, 0.2, 0.3])  # known run


def _prime(p, tokens, entropy):
    st = _Req(p.config)
    p.reqs["r"] = st
    r = _step(tokens, entropy)
    st.index.sync(r.token_ids)
    st.record_entropy(r)
    return st, r


# "1 2 3 4 5 6 7" occurs once; the history ends with "... 1 2 3"
HIST = [9, 1, 2, 3, 4, 5, 6, 7, 8, 8, 1, 2, 3]


def test_low_entropy_retrieves_the_continuation():
    p = _proposer()
    st, r = _prime(p, HIST, [0.2, 0.1, 0.3])
    tree = p._retrieve(st, r)
    assert tree.tokens == [4, 5, 6, 7, 8, 8, 1, 2] and set(tree.sources) == {"retrieval"}
    assert p.c["triggered"] == 1 and p.c["retrieved"] == 1


def test_high_entropy_falls_back_unless_the_trigger_is_off():
    p = _proposer(theta_entropy=1.0)
    st, r = _prime(p, HIST, [2.5, 3.0, 2.0])
    assert p._retrieve(st, r) is None and p.c["triggered"] == 0
    p = _proposer(theta_entropy=1.0, trigger=False)
    st, r = _prime(p, HIST, [2.5, 3.0, 2.0])
    assert p._retrieve(st, r).tokens[:4] == [4, 5, 6, 7]


def test_ema_feedback_from_the_next_step_and_filtering():
    p = _proposer(theta_score=0.3)
    st, r = _prime(p, HIST, [0.2, 0.1, 0.3])
    p._retrieve(st, r)
    # the target accepted 4 5 and then sampled 9 (bonus): R = 2/8 for end 3
    nxt = _step(HIST + [4, 5, 9], [0.1, 0.1, 0.1], draft_kept=8)
    st.index.sync(nxt.token_ids)
    p._feedback(st, nxt)
    assert st.scores.scores[3] == pytest.approx(0.7 * 0.5 + 0.3 * 2 / 8)
    assert p.c["retrieval_verified"] == 1 and p.c["retrieval_accepted"] == 2
    # a rejected draft twice more sinks the position below theta_score
    for _ in range(2):
        st.scores.feedback([3], None, 0, 8)
    st2, r2 = _prime(p, HIST, [0.2, 0.1, 0.3])
    st2.scores = st.scores
    assert p._retrieve(st2, r2) is None and p.c["filtered"] == 1


def test_top_candidates_merge_into_one_tree():
    # key "1 2" occurs at ends 2 and 6 with different continuations
    hist = [0, 1, 2, 7, 7, 1, 2, 8, 8, 0, 1, 2]
    p = _proposer(max_key=2, lambda_e=0.0)
    st, r = _prime(p, hist, [0.1, 0.1])
    tree = p._retrieve(st, r)
    # budget 8 shared by 2 candidates, the most recent (end 6) first
    assert tree.tokens[:4] == [8, 8, 0, 1] and tree.tokens[4:] == [7, 7, 1, 2]
    assert tree.parents[4] == -1
