"""`suffix_tree`: SuffixDecoding's draft trees, verified as trees.

SuffixDecoding (Oliaro et al., 2024) drafts from suffix trees over the
request's prompt and output and over earlier requests' outputs, and
speculates a *tree* of the likeliest continuations. Earlier requests'
outputs are kept per tenant (``isolation``): a request drafts only from
those of requests with the same ``cache_salt``. vLLM's built-in
``suffix`` method uses the same suffix trees but can verify only one path,
so it drafts that path alone. Here the whole tree is verified in one target
pass (the plugin's tree verification), and the cost-aware budget cuts it
per request and step with acceptance it learns per match length and fork
(``sources/suffix_cache.py``): a cheap row on the CPU is worth a branch when
the branch is accepted often enough, and not otherwise.

Model-free: no forward pass of its own, nothing captured from the target.
"""

from __future__ import annotations

from pydantic import Field

from vllm_specplug.config import MethodConfig, SpecplugConfigError
from vllm_specplug.engine.interface import Proposer, ProposerContext, ProposerStats, StepRequest
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.sources import suffix_cache
from vllm_specplug.sources.suffix_cache import TenantSuffixCaches


class SuffixTreeConfig(MethodConfig):
    tree: bool = True
    """Speculate a tree (the likeliest continuations best-first); False
    drafts the single likeliest path, as vLLM's ``suffix`` does."""
    max_tree_depth: int = Field(default=24, ge=1, le=1024)
    """Longest context suffix matched, and deepest draft (the suffix trees'
    depth)."""
    max_cached_requests: int = Field(default=10000, ge=0)
    """Earlier requests whose outputs stay in the global suffix trees, all
    tenants together (FIFO: the oldest response goes first, whoever's it
    is); 0 drafts from each request's own prompt and output only."""
    max_cached_tokens: int | None = Field(default=1 << 22, ge=0)
    """Response tokens the global suffix trees hold, all tenants together
    (a running request's response counts as it grows); past it the oldest
    responses are evicted first, as with ``max_cached_requests`` (counted
    as ``evicted_for_tokens``). The trees take about 350 bytes of host
    memory a token, so the default 4 M tokens bound them near 1.4 GiB.
    None: bounded by ``max_cached_requests`` alone."""
    max_tenants: int = Field(default=64, ge=1)
    """Tenants (``cache_salt`` values, plus the public pool of requests
    without one; see ``isolation``) that keep a global suffix tree of their
    earlier responses. Past it, the tenant drafted for least recently that
    has no request running loses its tree. Each tree costs memory in
    proportion to the responses it holds, which ``max_cached_requests``
    bounds across all tenants."""
    max_spec_factor: float = Field(default=1.0, ge=0.0)
    """A draft from a context match of ``m`` tokens holds at most
    ``max_spec_factor * m + max_spec_offset`` nodes (a short match is weak
    evidence for a long copy)."""
    max_spec_offset: float = 0.0
    """See ``max_spec_factor``."""
    min_token_prob: float = Field(default=0.1, ge=0.0, le=1.0)
    """Nodes whose count-based path probability is below this are not
    drafted."""

    def check_engine(self, vllm_config) -> None:
        if not suffix_cache.available():
            raise SpecplugConfigError(
                "method 'suffix_tree' needs the arctic-inference package (its "
                "suffix trees): pip install arctic-inference==0.3.0, or run "
                "scripts/setup.sh, which builds it")


class SuffixTreeProposer(Proposer):
    name = "suffix_tree"
    remembers_outputs = True  # the global response caches
    tenant_aware = True  # one response cache per tenant
    config_cls = SuffixTreeConfig

    def __init__(self, config: SuffixTreeConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)
        self.cache = TenantSuffixCaches(config.max_tree_depth, config.max_cached_requests,
                                        config.max_tenants, config.max_cached_tokens)

    def add_request(self, req_id: str) -> None:
        # a request the runner saw leave is fed again from its prompt
        self.cache.stop(req_id)

    def remove_request(self, req_id: str) -> None:
        self.cache.stop(req_id)

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        cfg: SuffixTreeConfig = self.config
        out: list[DraftTree | None] = []
        # the trees must hold every token before any request drafts from
        # them; a step none drafts in (the gate closed) leaves it for later
        feed = (self.cache.sync if any(r.sampled and r.budget > 0 for r in batch)
                else self.cache.hold)
        for req in batch:
            if not req.sampled:  # a prompt chunk: the prompt is fed once it is whole
                out.append(None)
                continue
            feed(req.req_id, req.tenant, req.token_ids, req.num_prompt_tokens)
            out.append(self.cache.draft(
                req.req_id, req.token_ids, req.budget, tree=cfg.tree and not req.chain_only,
                max_spec_factor=cfg.max_spec_factor, max_spec_offset=cfg.max_spec_offset,
                min_token_prob=cfg.min_token_prob))
        return out

    def stats(self) -> ProposerStats:
        # the proposer's time is the runner's (``propose_seconds``)
        return ProposerStats(counters={"evicted_for_tokens": self.cache.evicted_for_tokens},
                             gauges={"live_requests": self.cache.active,
                                     "cached_responses": self.cache.cached,
                                     "cached_tokens": self.cache.cached_tokens,
                                     "tenants": self.cache.tenants})
