"""`pld`: prompt lookup decoding, as a chain or as a small tree.

With ``tree_branches=1`` it drafts exactly what vLLM's built-in ``ngram``
drafts (longest suffix match, earliest occurrence); with more branches the
continuations of other matches that start with a different token are merged
into a trie.
"""

from __future__ import annotations

from pydantic import Field

from vllm_specplug.config import MethodConfig, option_error
from vllm_specplug.engine.interface import Proposer, ProposerStats, StepRequest
from vllm_specplug.engine.tree import DraftTree, TrieBuilder
from vllm_specplug.sources.ngram import match


class PLDConfig(MethodConfig):
    prompt_lookup_max: int = Field(default=4, ge=1, le=64)
    """Longest context suffix (in tokens) looked up in prompt + output."""
    prompt_lookup_min: int = Field(default=1, ge=1, le=64)
    """Shortest suffix that counts as a match."""
    tree_branches: int = Field(default=1, ge=1, le=16)
    """Distinct continuations merged into the draft tree; 1 drafts a chain."""
    branch_len: int = Field(default=4, ge=1, le=64)
    """Length cap of every continuation but the first (the first one gets
    the rest of the budget)."""

    def check_against(self, num_speculative_tokens: int) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise option_error(
                "prompt_lookup_min", f"must be <= prompt_lookup_max={self.prompt_lookup_max}",
                self.prompt_lookup_min)
        if self.tree_branches > num_speculative_tokens:
            raise option_error(
                "tree_branches", f"exceeds num_speculative_tokens={num_speculative_tokens}",
                self.tree_branches)


class PLDProposer(Proposer):
    name = "pld"
    config_cls = PLDConfig

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        cfg: PLDConfig = self.config
        out: list[DraftTree | None] = []
        for req in batch:
            room = req.budget
            if room <= 0:
                out.append(None)
                continue
            branches = 1 if req.chain_only else cfg.tree_branches
            n, begins = match(req.token_ids, cfg.prompt_lookup_min,
                              cfg.prompt_lookup_max, branches)
            conts = [req.token_ids[b : b + room] for b in begins]
            if not conts:
                out.append(None)
                continue
            # the match's length names the nodes' source: the cost-aware
            # budget learns each length's acceptance on its own
            # (engine/budget.AcceptanceModel)
            source = f"match{n}"
            if len(conts) == 1:
                out.append(DraftTree.chain(conts[0].tolist(), source))
                continue
            # Reserve room for the side branches so the first one can't eat
            # the whole budget.
            side = sum(min(cfg.branch_len, len(c)) for c in conts[1:])
            trie = TrieBuilder(room)
            trie.insert(conts[0][: max(1, room - side)], source=source)
            for c in conts[1:]:
                trie.insert(c[: cfg.branch_len], source=source)
            out.append(trie.build())
        return out

    def stats(self) -> ProposerStats:
        # stateless: everything is in token_ids
        return ProposerStats(gauges={"live_requests": 0})
