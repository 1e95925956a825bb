"""Who may draft from whose state: the tenant of a request.

A method that keeps state across requests (a suffix tree of past outputs,
an adjacency table that learns, a head's prefix store) would let one user's
acceptance depend on another's text. Verification is exact, so no one
receives another's tokens, but acceptance shows in latency, in streamed
chunk sizes and in per-request speculative metrics. vLLM's own prefix cache
answers the same problem with the request's ``cache_salt``; the plugin
follows it: requests draft only from the state of requests with the same
salt, and requests without one share a public pool.

The engine core (the one process that sees both the salt and the config)
tags every request with an opaque tenant id in
``SamplingParams.extra_args[TENANT_KEY]``: a keyed hash of the salt, so the
salt itself never travels to the workers and ids cannot be forged from
outside (the key never leaves the engine-core process; a client's own
``TENANT_KEY`` is overwritten). Workers only compare ids.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TENANT_KEY = "_specplug_tenant"
"""Private ``extra_args`` key the engine core sets; clients may not send it."""
PUBLIC = "public"
"""The tenant of requests without a ``cache_salt``."""
ISOLATION_MODES = ("salt", "strict", "off")
ISOLATION_SHARES = {
    "salt": "requests draft only from the state of requests with the same cache_salt; "
            "requests without one share a public pool",
    "strict": "no drafting state is kept across requests",
    "off": "one pool shared by every request (tenants can read each other's outputs "
           "through drafts)",
}
"""What each ``isolation`` mode shares, as the start-up log says it."""

# The key of the tenant hash. It lives in the engine-core process only and is
# new at every start: the workers compare tenant ids and never hash, and their
# state does not outlive the engine core, so nothing needs to carry it (and it
# must never go into the engine config: vLLM hashes that for its compile cache).
_KEY = secrets.token_bytes(32)


def tenant_of(salt: str | None, mode: str) -> str | None:
    """The tenant of a request with ``cache_salt`` ``salt`` under isolation
    ``mode``: :data:`PUBLIC`, ``"t:<keyed hash>"``, or None (share nothing).

    Any string is accepted: offline requests reach the engine without vLLM's
    HTTP checks on the salt."""
    if mode == "off":
        return PUBLIC
    if mode == "strict":
        return None
    if salt is None:
        return PUBLIC
    digest = hmac.new(_KEY, salt.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return "t:" + digest.hexdigest()[:32]


def isolation_of(vllm_config) -> str | None:
    """The isolation mode of an engine running a specplug method, None for
    any other engine."""
    from vllm_specplug.config import ADDITIONAL_CONFIG_KEY

    spec = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
    if not isinstance(spec, dict) or "options" not in spec:
        return None
    return spec["options"].get("isolation", "salt")


def tag_request(request, mode: str) -> None:
    """Set ``request``'s tenant (a vLLM ``Request`` in the engine core) from
    its ``cache_salt``, overwriting whatever the client put under
    :data:`TENANT_KEY`: an id is never taken from outside."""
    params = request.sampling_params
    if params is None:  # a pooling request: nothing drafts for it
        return
    extra = dict(params.extra_args or {})  # a new dict: the caller's stays as it was
    extra[TENANT_KEY] = tenant_of(request.cache_salt, mode)
    params.extra_args = extra


def install_engine_core_hook() -> None:
    """Tag every request with its tenant where it enters the engine core.

    ``EngineCore.preprocess_add_request`` is the one door of both the
    multiprocess engine core (its input thread) and the in-process one, and
    the one place that has both the request's ``cache_salt`` (which never
    reaches the workers) and the engine config. It runs before the scheduler
    hands ``sampling_params`` to the workers, for every child of an ``n > 1``
    request and for every streaming update."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.preprocess_add_request
    if getattr(original, "_specplug", False):
        return

    def preprocess_add_request(self, request):
        req, wave = original(self, request)
        mode = isolation_of(self.vllm_config)
        if mode is not None:
            tag_request(req, mode)
        return req, wave

    preprocess_add_request._specplug = True
    EngineCore.preprocess_add_request = preprocess_add_request


def request_tenant(sampling_params) -> str | None:
    """The tenant the engine core gave a request (worker side): None, share
    nothing, for a request it did not tag, so a missing tag fails closed."""
    extra = getattr(sampling_params, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    tenant = extra.get(TENANT_KEY)
    return tenant if isinstance(tenant, str) else None
