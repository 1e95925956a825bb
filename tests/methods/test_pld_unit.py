"""`pld` without an engine: what it drafts and how it names its nodes."""

from __future__ import annotations

import numpy as np
import torch

from tests.methods.budget import propose
from vllm_specplug.engine.interface import ProposerContext, StepRequest
from vllm_specplug.methods.pld import PLDConfig, PLDProposer


def _pld(**kw) -> PLDProposer:
    ctx = ProposerContext(vocab_size=100, hidden_size=8, num_speculative_tokens=6,
                          max_model_len=1024, device=torch.device("cpu"),
                          dtype=torch.float32, model_path="", tokenizer_path="")
    return PLDProposer(PLDConfig(**kw), ctx)


def _req(tokens) -> StepRequest:
    toks = np.asarray(tokens, dtype=np.int64)
    return StepRequest("r", toks, len(toks), True, len(toks) - 1)


def test_the_match_length_names_the_nodes_source():
    # "1 2 3 4" occurs earlier: a 4-token match copies what followed it
    (tree,) = propose(_pld(), [_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4])])
    assert tree.tokens == [5, 6, 7, 8, 9, 1] and tree.is_chain()
    assert tree.sources == ["match4"] * 6
    # only the last token recurs: a 1-token match, a weaker source
    (tree,) = propose(_pld(), [_req([7, 5, 6, 8, 9, 7])])
    assert tree.tokens[:2] == [5, 6] and set(tree.sources) == {"match1"}
    # branches of one match share its source
    (tree,) = propose(_pld(tree_branches=2), [_req([3, 4, 9, 3, 5, 8, 3])])
    assert sorted(tree.tokens[i] for i, p in enumerate(tree.parents) if p < 0) == [4, 5]
    assert set(tree.sources) == {"match1"}
    assert propose(_pld(), [_req([1, 2, 3])]) == [None]
