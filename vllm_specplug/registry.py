"""The specplug method registry (SGLang-style: name -> implementation), and
the one place a user's ``speculative_config`` becomes a validated config.

The built-in methods are the fixed table below; a third-party method calls
``register``. Each entry's class declares the same ``name``. Entries are
import paths, not classes, so that loading the plugin in a vLLM process
that does not use specplug costs one dict and no heavy imports (ScaNN, the
EAGLE head, ...).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from vllm_specplug.config import (
    MethodConfig,
    SpecplugConfigError,
    missing_option,
    option_error,
)

if TYPE_CHECKING:
    from vllm_specplug.engine.interface import Proposer

_METHODS: dict[str, str] = {
    "pld": "vllm_specplug.methods.pld:PLDProposer",
    "oracle": "vllm_specplug.methods.oracle:OracleProposer",
    "plain": "vllm_specplug.methods.plain:PlainProposer",
    "recycle": "vllm_specplug.methods.recycle:RecycleProposer",
    "adapld": "vllm_specplug.methods.adapld:AdaPLDProposer",
    "dresd": "vllm_specplug.methods.dresd:DReSDProposer",
    "eagle3_tree": "vllm_specplug.methods.eagle3_tree:Eagle3TreeProposer",
    "graft": "vllm_specplug.methods.graft:GraftProposer",
    "respec": "vllm_specplug.methods.respec:RespecProposer",
    "reader": "vllm_specplug.methods.reader:ReaderProposer",
    "suffix_tree": "vllm_specplug.methods.suffix_tree:SuffixTreeProposer",
    "auto": "vllm_specplug.methods.auto:AutoProposer",
}
SHIPPED: tuple[str, ...] = tuple(sorted(_METHODS))
"""The methods this package ships (``register`` may add others at run time)."""


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``"package.module:Class"`` (a Proposer subclass)."""
    if name in _BUILTIN_VLLM_METHODS:
        raise ValueError(f"'{name}' is a vLLM method name; pick another")
    _METHODS[name] = target


def names() -> list[str]:
    return sorted(_METHODS)


def is_registered(name: object) -> bool:
    return isinstance(name, str) and name in _METHODS


def get(name: str) -> type[Proposer]:
    try:
        target = _METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown specplug method '{name}' (known: {', '.join(names())})"
        ) from None
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if cls.name != name:
        raise ValueError(f"specplug method '{name}' -> {target}, whose name is '{cls.name}'")
    return cls


# ------------------------------------------------------------------ options


def build_config(method: str, options: dict[str, Any],
                 num_speculative_tokens: int | None = None) -> MethodConfig:
    """``method``'s validated options: pydantic's field checks, then the
    config's ``check_against(num_speculative_tokens)`` (skipped when it is
    None). Errors are one-line ``SpecplugConfigError``s naming the key."""
    from pydantic import ValidationError

    cls = get(method).config_cls
    for key, info in cls.model_fields.items():
        if info.is_required() and key not in options:
            raise missing_option(key, method, info.description or "")
    try:
        config = cls(**options)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "?"
        raise option_error(
            key, f"{err['msg']} (got {err.get('input')!r}, method '{method}')") from None
    if num_speculative_tokens is not None:
        config.check_against(num_speculative_tokens)
    return config


# The largest tree a step may verify when the user names none. The cost-aware
# budget sizes each step's tree at or below it, so a generous cap costs
# nothing where drafting does not pay; every method's default tree fits in it.
DEFAULT_NUM_SPECULATIVE_TOKENS = 16


def resolve(raw: dict[str, Any]) -> tuple[str, MethodConfig, dict[str, Any]]:
    """Split a user's speculative_config into (method, validated method
    config, the keys that stay with vLLM).

    Keys the method declares go to its config; keys vLLM's SpeculativeConfig
    knows stay with vLLM; anything else is an error naming the key.
    """
    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    method = raw.pop("method")
    own = set(get(method).config_cls.model_fields)
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
    config = build_config(method, mine)
    n = theirs.setdefault("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise option_error("num_speculative_tokens", f"must be a positive integer (got {n!r})")
    config.check_against(n)
    check_isolation(method, config)
    return method, config, theirs


def check_isolation(method: str, config: MethodConfig) -> None:
    """Refuse a method that drafts from earlier requests' outputs but does
    not keep them per tenant (``Proposer.tenant_aware``), unless the engine
    shares everything anyway (``isolation: off``)."""
    cls = get(method)
    if cls.remembers_outputs and not cls.tenant_aware and config.isolation != "off":
        raise option_error(
            "isolation", f"method '{method}' keeps other requests' outputs without "
            "keeping them apart by tenant (cache_salt); it can run only with "
            "isolation 'off' (every request drafts from every other's)", repr(config.isolation))


def _vllm_spec_fields() -> set[str]:
    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


# Names vLLM 0.32 owns; a plugin method may not shadow them.
_BUILTIN_VLLM_METHODS = frozenset(
    {"ngram", "ngram_gpu", "medusa", "mlp_speculator", "draft_model", "suffix",
     "custom_class", "eagle", "eagle3", "mtp", "extract_hidden_states", "dflash",
     "dspark"}
)
