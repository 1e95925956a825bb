"""`eagle3_tree` without an engine: start-up errors and the proposer's glue
(aux rows in, trees out) on the shipped head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.methods.budget import propose

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.registry import resolve as split_speculative_config
from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.methods.eagle3_tree import Eagle3TreeConfig, Eagle3TreeProposer


def _ctx(model: str, vocab: int, hidden: int, embed=None, n: int = 16) -> ProposerContext:
    return ProposerContext(vocab_size=vocab, hidden_size=hidden, num_speculative_tokens=n,
                           max_model_len=1024, device=torch.device("cpu"),
                           dtype=torch.float32, model_path=model, tokenizer_path=model,
                           embed_tokens=embed)


def test_unknown_target_needs_a_head(tiny_model):
    with pytest.raises(SpecplugConfigError, match=r"\['head'\] is required"):
        Eagle3TreeProposer(Eagle3TreeConfig(), _ctx(tiny_model, 512, 256,
                                                    torch.zeros(512, 256)))


def test_bad_options_fail_in_one_line(tmp_path):
    with pytest.raises(SpecplugConfigError, match="no EAGLE-3 head"):
        split_speculative_config({"method": "eagle3_tree", "num_speculative_tokens": 8,
                                  "head": str(tmp_path)})
    with pytest.raises(SpecplugConfigError, match="topk"):
        split_speculative_config({"method": "eagle3_tree", "num_speculative_tokens": 8,
                                  "topk": 0})


def test_proposer_feeds_every_request_and_respects_budgets(ref_model):
    """Two requests in one step: both states extend from their rows, the
    one near max_model_len gets a smaller tree, an unsampled chunk none."""
    from vllm_specplug.eagle3 import shipped_head_path

    embed = torch.randn(49152, 576) * 0.05
    ctx = _ctx(ref_model, 49152, 576, embed)
    ctx.max_model_len = 70
    prop = Eagle3TreeProposer(Eagle3TreeConfig(depth=4, topk=4), ctx)
    assert prop.needs().aux_layers == (2, 15, 27)
    assert prop.head_dir == shipped_head_path()
    g = torch.Generator().manual_seed(0)
    batch = []
    for rid, n, sampled in (("a", 30, True), ("b", 64, True), ("c", 20, False)):
        toks = np.arange(100, 100 + n + 1, dtype=np.int64)
        batch.append(StepRequest(req_id=rid, token_ids=toks, num_prompt_tokens=n,
                                 sampled=sampled, verified_pos=0,
                                 aux_hidden=torch.randn(n, 3 * 576, generator=g)))
    trees = propose(prop, batch)  # budgets set as the runner sets them
    assert len(trees[0]) == 16 and len(trees[1]) == 70 - 65 - 1 and trees[2] is None
    assert [prop.runtime.states[r].n for r in "abc"] == [30, 64, 20]
    prop.remove_request("a")
    assert "a" not in prop.runtime.states
    s = prop.report(prop.stats())
    assert s["extended_rows"] == 114 and s["draft"]["n"] == 1
