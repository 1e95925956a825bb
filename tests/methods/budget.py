"""What the runner does before ``propose``: one ``StepRequest.budget`` per
request (``draft_budget``), so method unit tests call methods as the engine
does."""

from __future__ import annotations

from vllm_specplug.engine.interface import draft_budget


def propose(proposer, batch, num_spec_to_schedule: int = 0):
    ctx = proposer.ctx
    for req in batch:
        req.budget = draft_budget(ctx.num_speculative_tokens, num_spec_to_schedule,
                                  ctx.max_model_len, len(req.token_ids), req.sampled)
    return proposer.propose(batch)
