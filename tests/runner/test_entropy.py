"""``Needs.entropy``: the runner hands a method the target's entropy at every
verified row (the root and the accepted path of a tree, the last prompt rows
at prefill). Checked against a recompute of the target with transformers on
the final sequences (float32), at every position the runner reported."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import engine, greedy
from vllm_specplug import registry
from vllm_specplug.engine.interface import Needs
from vllm_specplug.methods.pld import PLDProposer

pytestmark = pytest.mark.engine

SEEN: dict[str, dict[int, float]] = {}
"""prompt -> position p -> entropy of the distribution after token p."""
MULTI_ROW_STEPS = [0]


class EntropyProbe(PLDProposer):
    """PLD trees (so several rows get accepted per step) that record what
    the runner gives as entropies."""

    name = "entropy_probe"

    def needs(self) -> Needs:
        return Needs(entropy=True, prompt_entropy_rows=3)

    def propose(self, batch):
        for r in batch:
            if r.entropy is None or not r.sampled:
                continue
            ent = r.entropy.float().cpu().numpy()
            # the last row produced the newest token: position len - 2
            last = len(r.token_ids) - 2
            seen = SEEN.setdefault(str(r.token_ids[:r.num_prompt_tokens].tolist()), {})
            for j, h in enumerate(ent[::-1]):
                seen[last - j] = float(h)
            if len(ent) > 1 and len(r.token_ids) > r.num_prompt_tokens + 1:
                MULTI_ROW_STEPS[0] += 1
        return super().propose(batch)


def test_entropy_matches_target_recompute(ref_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.corpus import chat_ids

    registry.register("entropy_probe", "tests.runner.test_entropy:EntropyProbe")
    tok = AutoTokenizer.from_pretrained(ref_model)
    text = ("The cat sat on the mat. The dog sat on the log. The cat sat on the mat. "
            "Repeat the two sentences above three times.")
    prompts = [chat_ids(tok, text), chat_ids(tok, "Count from 1 to 20 in words.")]
    spec = {"method": "entropy_probe", "num_speculative_tokens": 8, "tree_branches": 3,
            "cost_aware": False}
    with engine(ref_model, spec, max_model_len=512) as llm:
        outs = greedy(llm, prompts, 32)
    assert MULTI_ROW_STEPS[0] > 0  # accepted paths gave several rows a step

    model = AutoModelForCausalLM.from_pretrained(ref_model, torch_dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        seq = prompt + out
        seen = SEEN[str(list(prompt))]
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        ref = torch.special.entr(torch.softmax(logits, -1)).sum(-1).numpy()
        pos = np.array(sorted(p for p in seen if p < len(seq) - 1))
        # every generated position and the last prompt rows were reported
        assert set(range(len(prompt) - 3, len(seq) - 2)) <= set(pos.tolist())
        got = np.array([seen[p] for p in pos])
        np.testing.assert_allclose(got, ref[pos], atol=2e-3, rtol=1e-3)


def test_entropy_formula_matches_entr_of_softmax_with_masked_entries():
    # the runner's one-pass form against the textbook one, masked (-inf)
    # entries and float16 logits included
    import torch

    from vllm_specplug.runner.runner import _entropy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4000, generator=g) * torch.tensor([[0.1], [1.0], [5.0], [20.0], [1.0]])
    x[4, :3990] = -float("inf")
    ref = torch.special.entr(torch.softmax(x.double(), -1)).sum(-1).float()
    torch.testing.assert_close(_entropy(x), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_entropy(x.half()), _entropy(x.half().float()))
    assert torch.isfinite(_entropy(x)).all()
