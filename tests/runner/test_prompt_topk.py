"""``Needs.prefill_topk``: the runner hands a method the target's top-k at
the last ``prefill_topk_rows`` rows of every prompt chunk, placed by
``StepRequest.topk_offset``. Checked against a recompute of the target
with transformers (float32): at every position the runner reported, the
top-1 is the target's argmax after that position's token, and
``node_tokens`` are the prompt's tokens there; the probabilities come
only when the method asks for them (``Needs.topk_probs``)."""

from __future__ import annotations

import pytest

from tests.conftest import engine, greedy
from vllm_specplug import registry
from vllm_specplug.engine.interface import Needs
from vllm_specplug.methods.pld import PLDProposer

pytestmark = pytest.mark.engine

ROWS = 5
SEEN: dict[str, dict[int, int]] = {}
"""prompt -> position p -> top-1 after token p, as the runner reported."""
CHUNKS: list[tuple[int, int]] = []  # (rows of top-k, offset) of prompt chunks


class TopkProbe(PLDProposer):
    name = "prompt_topk_probe"
    prefill_topk = True
    with_probs = False  # ids only (Needs.topk_probs), as the adjacency methods ask

    def needs(self) -> Needs:
        return Needs(topk=4, prefill_topk=self.prefill_topk, prefill_topk_rows=ROWS,
                     tree_topk=True, topk_probs=self.with_probs)

    def propose(self, batch):
        for r in batch:
            if r.topk_ids is None:
                continue
            assert (r.topk_probs is not None) == self.with_probs
            if r.verified_pos >= r.num_prompt_tokens:
                continue  # decode steps: covered by the lossless tests
            key = str(r.token_ids[:r.num_prompt_tokens].tolist())
            at = r.verified_pos + r.topk_offset
            top1 = r.topk_ids[:, 0].cpu().tolist()
            CHUNKS.append((len(top1), r.topk_offset))
            if self.prefill_topk:  # node_tokens: the input token of each row
                assert r.node_tokens.cpu().tolist() == r.token_ids[at:at + len(top1)].tolist()
            for j, t in enumerate(top1):
                SEEN.setdefault(key, {})[at + j] = int(t)
        return super().propose(batch)


class LastRowProbe(TopkProbe):
    """Without ``prefill_topk`` (or with the budget's gate closed) a prompt
    has only its last row's top-k: it follows the prompt's last token."""

    name = "prompt_last_row_probe"
    prefill_topk = False
    with_probs = True


@pytest.mark.parametrize("probe", [TopkProbe, LastRowProbe])
def test_prompt_topk_is_the_chunks_last_rows_in_place(ref_model, probe):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.corpus import chat_ids

    registry.register(probe.name, f"tests.runner.test_prompt_topk:{probe.__name__}")
    SEEN.clear()
    CHUNKS.clear()
    tok = AutoTokenizer.from_pretrained(ref_model)
    text = " ".join(f"Item {i}: the {w} is on the table." for i, w in
                    enumerate(["cup", "book", "pen", "lamp", "phone", "key", "plate"]))
    prompts = [chat_ids(tok, text), chat_ids(tok, "Name three colours.")]
    spec = {"method": probe.name, "num_speculative_tokens": 4,
            "cost_aware": False}
    # chunks of 32 tokens: the long prompt arrives in several
    with engine(ref_model, spec, max_model_len=512, enable_chunked_prefill=True,
                max_num_batched_tokens=32) as llm:
        greedy(llm, prompts, 4)
    assert any(off > 0 for _, off in CHUNKS)  # some chunk was longer than ROWS
    assert all(n <= (ROWS if probe.prefill_topk else 1) for n, _ in CHUNKS)
    rows = ROWS if probe.prefill_topk else 1

    model = AutoModelForCausalLM.from_pretrained(ref_model, torch_dtype=torch.float32)
    for prompt in prompts:
        seen = SEEN[str(list(prompt))]
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].argmax(-1).tolist()
        # the last prompt rows were reported, each where it belongs
        assert set(range(len(prompt) - rows, len(prompt))) <= set(seen)
        assert {p: want[p] for p in seen} == seen
