"""The fused decoder layer drafting runs (``eagle3/draft_layer.py``) against
the head's training forward (``Eagle3Draft._qkv`` / ``_post``, separate
projections and norms, rotary angles per call): the same function up to
float32 rounding, at positions past the rotary table's first size and in
any order."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def head():
    from vllm_specplug.eagle3 import shipped_head_path
    from vllm_specplug.eagle3.model import load_head

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(49152, 576, generator=g) * 0.05
    return load_head(shipped_head_path(), embed).eval()


def _inputs(head, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, head.cfg["vocab_size"], (rows,), generator=g)
    hidden = torch.randn(rows, head.cfg["hidden_size"], generator=g)
    return tokens, hidden


@pytest.mark.parametrize("positions", [[0, 1, 2, 3], [7, 3, 3, 900, 1023, 1024, 5000]])
def test_qkv_equals_the_training_forward(head, positions):
    from vllm_specplug.eagle3.draft_layer import DraftLayer

    layer = DraftLayer(head)
    pos = torch.tensor(positions)
    tokens, hidden = _inputs(head, len(positions), 1)
    with torch.no_grad():
        got = layer.qkv(tokens, hidden, pos)
        want = head._qkv(tokens, hidden, pos)
    assert layer._cos.shape[0] > max(positions)  # the table grew past them
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_post_equals_the_training_forward(head):
    from vllm_specplug.eagle3.draft_layer import DraftLayer

    layer = DraftLayer(head)
    a = head.midlayer.self_attn
    g = torch.Generator().manual_seed(2)
    attn = torch.randn(5, a.nh, a.hd, generator=g)
    residual = torch.randn(5, head.cfg["hidden_size"], generator=g)
    with torch.no_grad():
        torch.testing.assert_close(layer.post(attn, residual), head._post(attn, residual),
                                   atol=1e-5, rtol=1e-4)


def test_the_layer_shares_the_heads_unfused_weights(head):
    from vllm_specplug.eagle3.draft_layer import DraftLayer

    layer = DraftLayer(head)
    ml = head.midlayer
    assert layer.o_proj is ml.self_attn.o_proj and layer.down_proj is ml.mlp.down_proj
    assert layer.embed.data_ptr() == head.embed.data_ptr()
    assert not any(p.requires_grad for p in (layer.qkv_proj.weight,
                                              layer.gate_up_proj.weight))
