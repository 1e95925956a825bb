"""`recycle` on the real engine (reference model, float32) at a small
budget: measured template + copy path (shared table) stay
token-identical to plain decoding at batch 1 and 8, and a tree step reads
the device once (tests/helpers/host_reads.py)."""

from __future__ import annotations

import pytest

from tests.conftest import greedy
from tests.helpers.engine_checks import check_greedy_equal_on
from tests.helpers.prompts import COPY_MAX_TOKENS
from tests.methods.sampling import OneEngine, check_sampling_on

pytestmark = pytest.mark.engine


SPEC = {"method": "recycle", "num_speculative_tokens": 8, "cost_aware": False}


class TestOneEngine(OneEngine):
    spec = SPEC
    baseline = "copy_baseline"

    def test_recycle_small_budget_copy_path_lossless(self, llm, copy_baseline):
        stats = check_greedy_equal_on(llm, copy_baseline, COPY_MAX_TOKENS)
        m = stats["method"]
        assert stats["accepted_tokens"] > 0 and stats["tree_drafts"] > 0
        # the copy path was drafted and verified: its estimate has moved off the prior
        assert m["copy_first_n4"] != pytest.approx(0.7)

    def test_a_tree_step_reads_the_device_once_when_greedy(self, llm, copy_baseline, reads):
        """Trees from the adjacency table, the table learning from every
        tree row's top-k: greedy tree steps read once, sampled ones at most
        twice, and drafting reads nothing the target computed."""
        from vllm import SamplingParams, TokensPrompt

        prompts, ref = (x[:4] for x in copy_baseline)
        before = llm.collective_rpc("specplug_stats")[0]["tree_drafts"]
        assert greedy(llm, prompts, COPY_MAX_TOKENS) == ref
        n_greedy = len(reads["sample"])
        params = [SamplingParams(temperature=0.8, seed=s, max_tokens=COPY_MAX_TOKENS)
                  for s in range(4)]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                     use_tqdm=False)
        assert llm.collective_rpc("specplug_stats")[0]["tree_drafts"] > before
        greedy_steps, sampled_steps = reads["sample"][:n_greedy], reads["sample"][n_greedy:]
        tree_steps = [r for r in greedy_steps if r[0]]
        assert tree_steps, "no greedy tree step"
        assert all(n == 1 for _, _, n, _ in tree_steps), tree_steps
        assert all(n <= 1 for _, _, n, _ in greedy_steps), greedy_steps
        assert any(trees and not g for trees, g, _, _ in sampled_steps), "no sampled tree step"
        assert all(n <= 2 for _, _, n, _ in sampled_steps), sampled_steps
        assert all(n == 0 for _, n, _ in reads["propose"]), reads["propose"]

    # slow: the rule that keeps the distribution is the runner's tree sampling, checked
    # in the default suite for every source at once, the head included (auto), and
    # for the head alone where arctic-inference is missing (eagle3_tree)
    @pytest.mark.slow
    def test_sampling_keeps_target_distribution(self, ref_model, llm):
        # the shared table learns from the earlier samples of the same prompt,
        # so later samples are drafted and verified through its trees
        check_sampling_on(llm, SPEC, ref_model, "Count from 1 to 10.")
