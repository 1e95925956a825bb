"""Retrieval-method steps on the synthetic embeddings of
``tests.helpers.retrieval``: a CPU context and one request's step."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.engine.interface import ProposerContext, StepRequest
from tests.helpers.retrieval import H, V, embeddings, unit


def make_ctx(n_spec=8, embed=None, layers=4, max_len=4096):
    """A CPU float32 context over the synthetic embeddings."""
    return ProposerContext(
        vocab_size=V, hidden_size=H, num_speculative_tokens=n_spec,
        max_model_len=max_len, device=torch.device("cpu"), dtype=torch.float32,
        model_path="", tokenizer_path="",
        embed_tokens=embeddings() if embed is None else embed,
        num_hidden_layers=layers,
    )


def step(tokens, verified_pos=0, hidden=None, topk=None, req_id="r", chain_only=False,
         sampled=True):
    """One request's step: ``tokens`` with rows from ``verified_pos`` on,
    unit hidden states by position unless given."""
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = len(tokens) - 1 - verified_pos
    if hidden is None:
        hidden = torch.stack([torch.from_numpy(unit(p)) for p in range(verified_pos, verified_pos + rows)])
    ids = probs = None
    if topk is not None:
        ids, probs = topk
    return StepRequest(req_id=req_id, token_ids=tokens, num_prompt_tokens=len(tokens) - 1,
                       sampled=sampled, verified_pos=verified_pos, layer_hidden=hidden,
                       topk_ids=ids, topk_probs=probs, chain_only=chain_only)
