"""The oracle's trees must accept exactly what it claims, or the engine tests
built on it would blame the engine for the oracle's mistakes."""

from __future__ import annotations

import random

import numpy as np
import torch

from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.methods.oracle import OracleConfig, OracleProposer, _random_tree
from tests.methods.budget import propose


def test_nothing_hangs_below_the_end_of_a_short_truth():
    # Below the truth's end the target's token is unknown: a random node
    # there could be accepted by chance (small vocabularies make it likely).
    truth = [5, 6]
    ends = 0
    for seed in range(200):
        # Unshuffled, the true path is nodes 0..depth-1.
        tree = _random_tree(random.Random(seed), truth, 12, 6, 8, False)
        depth = tree.follow(truth)[1]
        assert tree.tokens[:depth] == truth[:depth]
        if depth == len(truth):
            ends += 1
            assert depth - 1 not in tree.parents
    assert ends > 20


def test_counts_only_the_verified_prefix(tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text("[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]")
    ctx = ProposerContext(vocab_size=50, hidden_size=4, num_speculative_tokens=6,
                          max_model_len=64, device=torch.device("cpu"),
                          dtype=torch.float32, model_path="", tokenizer_path="")
    prop = OracleProposer(OracleConfig(reference_file=str(ref), shuffle=False,
                                       max_depth=4), ctx)

    def step(n, kept):
        req = StepRequest(req_id="r", token_ids=np.arange(1, n + 1), num_prompt_tokens=2,
                          sampled=True, verified_pos=n - 1, draft_kept=kept)
        return propose(prop, [req])[0]

    tree = step(2, 0)
    assert prop.drafts == 0  # proposed, not yet verified
    step(3, 1)  # the scheduler kept one node
    assert prop.drafts == 1
    assert prop.expected_accepted == tree.truncated(1).follow([3, 4, 5, 6, 7, 8])[1]
    step(4, 0)  # nothing verified (e.g. preempted and resumed)
    assert prop.drafts == 1

