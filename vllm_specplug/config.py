"""Typed options for specplug methods: the types and the one error format.

Options travel in vLLM's own ``speculative_config`` JSON next to
``method`` and ``num_speculative_tokens``. Each method declares a
``MethodConfig`` subclass; a field's docstring is its documentation (the
tables of ``docs/options.md`` are generated from it), as in vLLM's config
classes. Turning a
user's dict into a validated config is the registry's job
(``registry.resolve`` / ``registry.build_config``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The key under VllmConfig.additional_config that carries the method to the
# engine core and workers (it is pickled with the config).
ADDITIONAL_CONFIG_KEY = "specplug"

# Under that entry, where the runner records what of the method shapes the
# target's compiled graph (``plugin._hash_graph_not_options``).
GRAPH_KEY = "target_graph"

TOOL_KV_CACHE_BYTES = 2 << 30
"""KV cache of the engines the command-line tools start (head data,
``graft calibrate``, ``reader tune``). vLLM's CPU default reserves 92% of
the machine's memory and refuses to start beside any other process; these
runs need far less."""

_NO_VALUE = object()


class SpecplugConfigError(ValueError):
    """A bad speculative_config: the message is one line naming the key."""


def option_error(key: str, problem: str, value: Any = _NO_VALUE) -> SpecplugConfigError:
    """The start-up error for option ``key``, one line:
    ``speculative_config['key']: problem``, or with the offending value
    ``speculative_config['key']=value problem``."""
    head = f"speculative_config['{key}']"
    if value is _NO_VALUE:
        return SpecplugConfigError(f"{head}: {problem}")
    return SpecplugConfigError(f"{head}={value} {problem}")


def missing_option(key: str, method: str, hint: str = "") -> SpecplugConfigError:
    """``speculative_config['key'] is required for method 'm' (hint)``."""
    hint = " ".join(hint.split())[:160]
    return SpecplugConfigError(
        f"speculative_config['{key}'] is required for method '{method}'"
        + (f" ({hint})" if hint else ""))


class MethodConfig(BaseModel):
    """Options every specplug method has."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )

    cost_aware: bool = True
    """Cut every step's trees to what pays: a controller shared by every
    method (``engine/budget/``) picks each request's tree size, zero
    included, to maximise expected tokens per second from the step time it
    measures and the acceptance it observes. False pins the size: every tree
    the method drafts is verified, up to ``num_speculative_tokens`` nodes."""

    max_request_faults: int = Field(default=3, ge=0)
    """A request whose method hooks (``add_request``, ``propose``, ...)
    fail this many times in a row stops drafting for the rest of its life:
    it decodes plainly and the method no longer sees it
    (``runner/guard.py``; counted as ``requests_stopped_drafting``). A
    single fault only costs that request its draft for one step. 0 never
    stops a request."""

    max_draft_ms: float = Field(default=50.0, ge=0.0)
    """Time budget (milliseconds) of one step's request-by-request lookup
    work: retrieval and search over each request's tokens or a datastore
    (``adapld``, ``respec``, ``reader``, ``auto``). Once a step has spent
    it, the requests not yet reached skip that work this step: they get the
    method's batched model draft where it has one (``reader``, ``respec``,
    ``auto`` with a head), else no draft, and decode plainly (output is
    unchanged). The requests skipped go first next step; skips are counted
    as ``deadline_skips``. 0: no limit. Methods whose work is one batched
    pass ignore it."""

    isolation: Literal["salt", "strict", "off"] = "salt"
    """Whose state a request may draft from, for methods that keep state
    across requests (a suffix tree of earlier outputs, an adjacency table
    that learns). ``salt``: only that of requests with the same
    ``cache_salt`` (vLLM's own field, which keys its prefix cache the same
    way); requests without a salt share one public pool. ``strict``: no
    cross-request state at all; every request drafts from its own tokens
    only. ``off``: one pool shared by every request, the most acceptance,
    but a user's acceptance (latency, streamed chunk sizes, per-request
    speculative metrics) then depends on other users' text. Verification is
    exact in every mode: no one ever receives another's tokens."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def check_against(self, num_speculative_tokens: int) -> None:
        """Checks across options and ``num_speculative_tokens`` that field
        validators cannot make; raise ``option_error(...)``. Runs at
        start-up, before the engine is built."""

    def check_engine(self, vllm_config) -> None:
        """Checks that need the engine's whole config (the model, the files
        options name: a datastore, a table, a head); raise
        ``SpecplugConfigError`` naming the key. Runs in the front end after
        vLLM built its config, before any engine process starts."""
