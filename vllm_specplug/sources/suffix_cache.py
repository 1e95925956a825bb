"""Suffix-tree drafting over every request's prompt and all recent outputs
(SuffixDecoding, Oliaro et al. 2024), as a piece any method can compose.

The trees themselves are Arctic Inference's ``SuffixDecodingCache`` (C++; the
library vLLM's own ``suffix`` method uses, built by ``scripts/setup.sh``):
one suffix tree per running request over its prompt and output, and one
global tree over the outputs of up to ``max_cached_requests`` earlier and
running requests (one per tenant, ``TenantSuffixCaches``: requests draft
only from responses of requests with the same ``cache_salt``), each node
counting how often its continuation occurred.
A draft follows the longest matches of the context's last tokens and
expands the continuations best-first by their count-based probability.

What this piece adds is the bookkeeping a specplug method needs: requests
are synced from ``StepRequest.token_ids`` (only the tokens not fed yet; a
request that comes back after preemption starts over, its earlier response
evicted from the global tree first), and a draft comes back as a
``DraftTree`` -- a real tree, which vLLM's ``suffix`` cannot verify and so
flattens to one path -- with per-node scores and sources for the
cost-aware budget.

Sources: the budget learns ``P(accepted | parent accepted)`` per source,
so each node is named by what predicts its acceptance: the length of the
context match the draft grew from (``m1``, ``m2``, ``m4``, ``m8``: a long
match is a copy, a short one a guess) and whether the node is a fork
(``f``: its count-based probability is below its parent's, i.e. other
continuations were seen there too).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from vllm_specplug.engine.tree import DraftTree

logger = logging.getLogger(__name__)

_MATCH_BUCKETS = (8, 4, 2, 1)


def _load_cache_class():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:  # checked at start-up by the method's config
        raise ImportError(
            "suffix-tree drafting needs Arctic Inference's suffix trees: "
            "pip install arctic-inference==0.3.0 (scripts/setup.sh builds it)") from e
    return SuffixDecodingCache


def available() -> bool:
    try:
        _load_cache_class()
    except ImportError:
        return False
    return True


def match_source(match_len: int, fork: bool) -> str:
    bucket = next(b for b in _MATCH_BUCKETS if match_len >= b) if match_len >= 1 else 1
    return f"m{bucket}{'f' if fork else ''}"


def to_draft_tree(token_ids: Iterable[int], parents: Iterable[int],
                  probs: Iterable[float], match_len: int) -> DraftTree:
    """A suffix draft as a ``DraftTree``: Arctic's drafts are laid out
    best-first by path probability, each node after its parent (-1: the
    root), which is the topological order a ``DraftTree`` needs."""
    tokens, parents, probs = list(token_ids), list(parents), list(probs)
    sources = []
    for i, p in enumerate(parents):
        parent_prob = 1.0 if p < 0 else probs[p]
        sources.append(match_source(match_len, probs[i] < parent_prob))
    return DraftTree(tokens, parents, scores=probs, sources=sources)


class SuffixCache:
    """Per-request and global suffix trees, synced from each step's tokens."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000) -> None:
        self._cache = _load_cache_class()(max_tree_depth=max_tree_depth,
                                          max_cached_requests=max_cached_requests)
        self.max_tree_depth = max_tree_depth
        self._fed: dict[str, int] = {}  # req_id -> tokens in its trees

    def sync(self, req_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> bool:
        """Feed ``req_id``'s tokens that its trees do not hold yet (a request
        seen for the first time starts with its prompt). True when the
        request started here (its response is then cached globally, if this
        cache keeps responses)."""
        fed = self._fed.get(req_id)
        started = fed is None
        if started:
            # start_request evicts a response cached under the same id (a
            # preempted request coming back): it is fed again below
            self._cache.start_request(
                req_id, np.ascontiguousarray(token_ids[:num_prompt_tokens], dtype=np.int32))
            self._fed[req_id] = fed = num_prompt_tokens
        self.append(req_id, token_ids[fed:])
        return started

    def fed(self, req_id: str) -> int | None:
        """Tokens of the request its trees hold; None: not started here."""
        return self._fed.get(req_id)

    def append(self, req_id: str, tokens: np.ndarray) -> None:
        """Feed a started request's next ``tokens`` (after ``fed``)."""
        if len(tokens):
            self._cache.add_active_response(req_id, np.ascontiguousarray(tokens,
                                                                         dtype=np.int32))
            self._fed[req_id] += len(tokens)

    def stop(self, req_id: str) -> None:
        """The request left (finished, aborted, preempted): drop its own tree;
        its response stays in the global tree for later requests."""
        if self._fed.pop(req_id, None) is not None:
            self._cache.stop_request(req_id)

    def evict(self, req_id: str) -> None:
        """Drop ``req_id``'s response from the global tree, if it is there."""
        if req_id in self._cache.cached_requests:
            self._cache.evict_cached_response(req_id)

    def draft(self, req_id: str, token_ids: np.ndarray, max_nodes: int, *,
              tree: bool = True, max_spec_factor: float = 1.0,
              max_spec_offset: float = 0.0, min_token_prob: float = 0.1) -> DraftTree | None:
        """The best draft (a tree, or one path) after ``token_ids`` for a
        synced request, at most ``max_nodes`` nodes; None when nothing
        matches."""
        if max_nodes <= 0:
            return None
        context = np.ascontiguousarray(token_ids[-self.max_tree_depth:], dtype=np.int32)
        d = self._cache.speculate(req_id, context, max_spec_tokens=max_nodes,
                                  max_spec_factor=max_spec_factor,
                                  max_spec_offset=max_spec_offset,
                                  min_token_prob=min_token_prob, use_tree_spec=tree)
        if not d.token_ids:
            return None
        return to_draft_tree(d.token_ids, d.parents, d.probs, d.match_len)

    @property
    def active(self) -> int:
        return len(self._fed)

    @property
    def cached(self) -> int:
        return len(self._cache.cached_requests)


_UNSEEN = object()


class TenantSuffixCaches:
    """One ``SuffixCache`` per tenant (``StepRequest.tenant``): a request
    drafts from its own trees and from the responses of its own tenant only.

    Tenant None (isolation ``strict``, or a request the engine core did not
    tag) gets a cache that keeps no response: each such request drafts from
    its own prompt and output only. At most ``max_tenants`` tenants keep a
    cache; past that the least recently drafted-for tenant without a live
    request loses its cache (its earlier responses), so the bound can be
    passed only while every cached tenant has a request running. Responses
    are counted across tenants: ``max_cached_requests`` in all, and at most
    ``max_cached_tokens`` response tokens in all (a running request's
    response counts as it grows), the oldest evicted first whichever tenant
    it belongs to, so memory does not grow with the number of tenants.
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_tenants: int = 64, max_cached_tokens: int | None = None) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_tenants = max_tenants
        self.max_cached_tokens = max_cached_tokens
        self._caches: OrderedDict[str, SuffixCache] = OrderedDict()  # least recent first
        self._private = SuffixCache(max_tree_depth, max_cached_requests=0)
        self._tenant_of: dict[str, str | None] = {}  # live request -> its tenant
        # every tenant's cached responses, oldest first: their tokens
        self._responses: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.cached_tokens = 0
        """Response tokens in the global trees, all tenants together."""
        self.evicted_for_tokens = 0
        """Responses evicted to stay under ``max_cached_tokens``."""
        self._held: dict[str, tuple[str | None, np.ndarray, int]] = {}
        """Requests whose tokens wait for their next ``sync`` (``hold``)."""

    def hold(self, req_id: str, tenant: str | None, token_ids: np.ndarray,
             num_prompt_tokens: int) -> None:
        """``sync`` later: the tokens the trees lack wait for the request's
        next ``sync`` or its ``stop`` (then fed first, so its whole response
        is cached). For steps in which no request drafts (the cost-aware
        gate closed): feeding the trees a token at a time costs tens of
        microseconds a request, most of it per call, and nothing reads them
        until some request drafts again. A request its tenant's trees do not
        hold yet is synced at once (its prompt is fed once, not copied every
        step)."""
        cache = self._private if tenant is None else self._caches.get(tenant)
        fed = (cache.fed(req_id) if cache is not None
               and self._tenant_of.get(req_id, _UNSEEN) == tenant else None)
        if fed is None:
            self.sync(req_id, tenant, token_ids, num_prompt_tokens)
        elif len(token_ids) > fed:
            # a copy: ``token_ids`` is a view of the runner's row, which
            # another request takes once this one leaves
            self._held[req_id] = (tenant, np.array(token_ids[fed:], dtype=np.int32),
                                  num_prompt_tokens)

    def _flush(self, req_id: str) -> None:
        """Feed what the request held (``hold``) to its tenant's trees."""
        held = self._held.pop(req_id, None)
        if held is None:
            return
        tenant, tokens, num_prompt_tokens = held
        cache = self._private if tenant is None else self._caches.get(tenant)
        if cache is None or self._tenant_of.get(req_id, _UNSEEN) != tenant:
            return  # its tenant's trees were dropped meanwhile
        cache.append(req_id, tokens)
        self._count_tokens(tenant, req_id, cache.fed(req_id) - num_prompt_tokens)

    def sync(self, req_id: str, tenant: str | None, token_ids: np.ndarray,
             num_prompt_tokens: int) -> None:
        """``SuffixCache.sync`` in the cache of ``tenant``."""
        if self._tenant_of.get(req_id, tenant) != tenant:
            self.stop(req_id)  # never fed to two tenants' trees
        self._held.pop(req_id, None)  # ``token_ids`` has every token it held
        cache = self._cache_of(tenant)
        self._tenant_of[req_id] = tenant
        if cache.sync(req_id, token_ids, num_prompt_tokens) and tenant is not None:
            self._count_response(tenant, req_id)
        self._count_tokens(tenant, req_id, len(token_ids) - num_prompt_tokens)

    def stop(self, req_id: str) -> None:
        """``SuffixCache.stop`` in the cache the request was fed to, after
        what it held (``hold``)."""
        self._flush(req_id)
        tenant = self._tenant_of.pop(req_id, _UNSEEN)
        if tenant is _UNSEEN:
            return
        cache = self._private if tenant is None else self._caches.get(tenant)
        if cache is not None:
            cache.stop(req_id)

    def draft(self, req_id: str, token_ids: np.ndarray, max_nodes: int,
              **kwargs) -> DraftTree | None:
        """``SuffixCache.draft`` for a synced request, from its tenant's trees."""
        tenant = self._tenant_of.get(req_id, _UNSEEN)
        if tenant is _UNSEEN:
            return None
        cache = self._private if tenant is None else self._caches[tenant]
        return cache.draft(req_id, token_ids, max_nodes, **kwargs)

    def _cache_of(self, tenant: str | None) -> SuffixCache:
        if tenant is None:
            return self._private
        cache = self._caches.get(tenant)
        if cache is None:
            # each tenant's own FIFO never evicts before the count across
            # tenants does (_count_response)
            cache = SuffixCache(self.max_tree_depth, self.max_cached_requests)
            self._caches[tenant] = cache
            self._drop_idle_tenants(keep=tenant)
        self._caches.move_to_end(tenant)
        return cache

    def _drop_idle_tenants(self, keep: str) -> None:
        while len(self._caches) > self.max_tenants:
            idle = next((t for t, c in self._caches.items() if t != keep and not c.active),
                        None)
            if idle is None:  # every other tenant has a request running
                return
            del self._caches[idle]
            for key in [k for k in self._responses if k[0] == idle]:
                self.cached_tokens -= self._responses.pop(key)

    def _count_response(self, tenant: str, req_id: str) -> None:
        if not self.max_cached_requests:
            return
        # a request started again (preempted) is fed from its prompt again
        self.cached_tokens -= self._responses.pop((tenant, req_id), 0)
        self._responses[(tenant, req_id)] = 0
        while len(self._responses) > self.max_cached_requests:
            self._evict_oldest()

    def _count_tokens(self, tenant: str | None, req_id: str, tokens: int) -> None:
        """The response's length now, for a response the global trees keep
        (none for tenant None, or without ``max_cached_requests``); the
        oldest responses are evicted while all of them hold more than
        ``max_cached_tokens``."""
        key = (tenant, req_id)
        if tenant is None or key not in self._responses:
            return
        self.cached_tokens += tokens - self._responses[key]
        self._responses[key] = tokens
        cap = self.max_cached_tokens
        if cap is None:
            return
        while self.cached_tokens > cap and self._responses:
            if not self.evicted_for_tokens:
                logger.warning("specplug: suffix trees reached max_cached_tokens=%d; the "
                               "oldest responses are evicted (counted as "
                               "evicted_for_tokens; logged once)", cap)
            self.evicted_for_tokens += 1
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        (old_tenant, old_req), tokens = self._responses.popitem(last=False)
        self.cached_tokens -= tokens
        cache = self._caches.get(old_tenant)
        if cache is not None:
            cache.evict(old_req)

    @property
    def tenants(self) -> int:
        return len(self._caches)

    @property
    def active(self) -> int:
        return self._private.active + sum(c.active for c in self._caches.values())

    @property
    def cached(self) -> int:
        return sum(c.cached for c in self._caches.values())
