"""Per-request switches a client sends in vLLM's request extension fields.

Over HTTP they are ``vllm_xargs`` (completions, chat, responses); offline,
``SamplingParams(extra_args=...)``. Both arrive as
``SamplingParams.extra_args``, which reaches the workers with the request.
The front end validates them (``plugin._validate_specplug_request``: a bad
one is an HTTP 400 naming the field) and the worker reads them with the
same helpers, so both sides agree on what a request asked for.

- ``specplug_speculate`` (default true): false means this request never
  drafts, and its tokens neither feed nor read any method state shared with
  other requests.
- ``specplug_relaxed``: opt in to (true) or out of (false) a method's LOSSY
  relaxed verification (respec's ``relaxed_lossy``), where the server
  allows it.

vLLM's request models turn JSON ``true``/``false`` into ``1``/``0`` in
``vllm_xargs``, so those two integers are accepted as booleans; anything
else (``"true"``, ``2``, ``0.0``) is refused rather than guessed at.
"""

from __future__ import annotations

from typing import Any

SPECULATE = "specplug_speculate"
RELAXED = "specplug_relaxed"
FLAGS = (SPECULATE, RELAXED)
"""Every ``specplug_*`` key a client may send."""
PUBLIC_PREFIX = "specplug_"
PRIVATE_PREFIX = "_specplug"
"""Keys the plugin itself sets (``tenancy.TENANT_KEY``); never from a client."""


class RequestFlagError(ValueError):
    """A client's ``extra_args`` entry the plugin refuses; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def as_bool(value: Any) -> bool | None:
    """``value`` as a flag: True/False, or the 1/0 JSON booleans become;
    None for anything else."""
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    return None


def check_extra_args(extra_args: dict[str, Any] | None) -> None:
    """Refuse the plugin's keys a client may not send or got wrong: a
    private key, an unknown ``specplug_*`` key, a flag that is not a
    boolean. Other keys belong to vLLM or other plugins and are left alone."""
    for key, value in (extra_args or {}).items():
        if not isinstance(key, str):
            continue
        if key.startswith(PRIVATE_PREFIX):
            raise RequestFlagError(key, f"vllm_xargs['{key}'] is reserved for the server")
        if not key.startswith(PUBLIC_PREFIX):
            continue
        if key not in FLAGS:
            raise RequestFlagError(key, f"unknown vllm_xargs field '{key}' "
                                        f"(specplug fields: {', '.join(FLAGS)})")
        if as_bool(value) is None:
            raise RequestFlagError(key, f"vllm_xargs['{key}'] must be true or false, "
                                        f"got {value!r}")


def flag(extra_args: dict[str, Any] | None, key: str, default: bool) -> bool:
    """The request's value of flag ``key``, ``default`` when absent (or not a
    boolean: the front end refuses those, so only a request built around it
    gets here)."""
    value = as_bool((extra_args or {}).get(key))
    return default if value is None else value


def speculates(extra_args: dict[str, Any] | None) -> bool:
    """The request may draft (``specplug_speculate``, default true)."""
    return flag(extra_args, SPECULATE, True)


def asked_relaxed(extra_args: dict[str, Any] | None) -> bool:
    """The request explicitly opted in to relaxed verification."""
    return flag(extra_args, RELAXED, False)


def wants_relaxed(extra_args: dict[str, Any] | None, server_mode: Any) -> bool:
    """Relaxed (LOSSY) verification applies to this request, given the
    server's ``relaxed_lossy`` (False, True, or ``"opt_in"``): under True
    every request unless it sends ``specplug_relaxed: false``; under
    ``"opt_in"`` only requests that send ``specplug_relaxed: true``; never
    under False, nor for a request that does not speculate."""
    if not server_mode or not speculates(extra_args):
        return False
    return flag(extra_args, RELAXED, server_mode is True)
