"""Typed, validated options for specplug methods.

Options travel in vLLM's own ``speculative_config`` JSON next to
``method`` and ``num_speculative_tokens``. Each method declares a
``MethodConfig`` subclass; a field's docstring is its documentation (the
README table is generated from it), as in vLLM's config classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

# The key under VllmConfig.additional_config that carries the method to the
# engine core and workers (it is pickled with the config).
ADDITIONAL_CONFIG_KEY = "specplug"


class SpecplugConfigError(ValueError):
    """A bad speculative_config: the message is one line naming the key."""


class MethodConfig(BaseModel):
    """Options every specplug method has."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )

    cost_aware: bool = True
    """Cut every step's trees to what pays: a controller shared by every
    method (``engine/budget.py``) picks each request's tree size, zero
    included, to maximise expected tokens per second from the step time it
    measures and the acceptance it observes. False pins the size: every tree
    the method drafts is verified, up to ``num_speculative_tokens`` nodes."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def _vllm_spec_fields() -> set[str]:
    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def split_speculative_config(raw: dict[str, Any]) -> tuple[str, MethodConfig, dict]:
    """Split a user's speculative_config into (method, method config, vLLM keys).

    Keys the method declares go to its config; keys vLLM's SpeculativeConfig
    knows stay with vLLM; anything else is an error naming the key.
    """
    from vllm_specplug import registry

    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    method = raw.pop("method")
    cls = registry.get(method).config_cls
    own = set(cls.model_fields)
    vllm_keys = _vllm_spec_fields() - {"method", "model"}
    mine, theirs = {}, {}
    for key, value in raw.items():
        if key in own:
            mine[key] = value
        elif key in vllm_keys:
            theirs[key] = value
        else:
            known = ", ".join(sorted(own | {"num_speculative_tokens"}))
            raise SpecplugConfigError(
                f"speculative_config: unknown key '{key}' for method '{method}' "
                f"(method options: {known})"
            )
    try:
        config = cls(**mine)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "?"
        raise SpecplugConfigError(
            f"speculative_config['{key}']: {err['msg']} "
            f"(got {err.get('input')!r}, method '{method}')"
        ) from None
    n = theirs.get("num_speculative_tokens")
    if n is None:
        raise SpecplugConfigError(
            f"speculative_config['num_speculative_tokens'] is required "
            f"for method '{method}'"
        )
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecplugConfigError(
            f"speculative_config['num_speculative_tokens']: must be a positive "
            f"integer (got {n!r})"
        )
    check = getattr(config, "check_against", None)
    if check is not None:
        check(n)
    return method, config, theirs
