"""Helpers of the method unit tests: ``propose`` calls a method as the
runner does (one ``StepRequest.budget`` per request, ``draft_budget``);
``tree_paths`` lists a tree's root-to-node token paths."""

from __future__ import annotations

from vllm_specplug.engine.interface import draft_budget


def propose(proposer, batch, num_spec_to_schedule: int = 0):
    ctx = proposer.ctx
    for req in batch:
        req.budget = draft_budget(ctx.num_speculative_tokens, num_spec_to_schedule,
                                  ctx.max_model_len, len(req.token_ids), req.sampled)
    return proposer.propose(batch)


def tree_paths(tree) -> list[tuple[int, ...]]:
    """Per node, the tokens from the root's child down to it."""
    out: list[tuple[int, ...]] = []
    for p, tok in zip(tree.parents, tree.tokens):
        out.append((out[p] if p >= 0 else ()) + (int(tok),))
    return out
