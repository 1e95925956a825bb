"""``ProposerContext``s of the method unit tests."""

from __future__ import annotations

import torch

from vllm_specplug.engine.interface import ProposerContext


def proposer_ctx(model: str, vocab: int, hidden: int, embed=None, n: int = 16) -> ProposerContext:
    """A CPU float32 context of ``model`` with ``n`` speculative tokens."""
    return ProposerContext(vocab_size=vocab, hidden_size=hidden, num_speculative_tokens=n,
                           max_model_len=1024, device=torch.device("cpu"),
                           dtype=torch.float32, model_path=model, tokenizer_path=model,
                           embed_tokens=embed)


def ref_model_ctx(ref_model: str) -> ProposerContext:
    """The reference model's shape, with random input embeddings."""
    return proposer_ctx(ref_model, 49152, 576, torch.randn(49152, 576) * 0.05)
