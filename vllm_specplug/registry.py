"""The specplug method registry (SGLang-style: name -> implementation).

Entries are import paths, not classes, so that loading the plugin in a vLLM
process that does not use specplug costs one dict and no heavy imports
(ScaNN, the EAGLE head, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_specplug.engine.interface import Proposer

_METHODS: dict[str, str] = {
    "pld": "vllm_specplug.methods.pld:PLDProposer",
    "oracle": "vllm_specplug.methods.oracle:OracleProposer",
    "recycle": "vllm_specplug.methods.recycle:RecycleProposer",
    "adapld": "vllm_specplug.methods.adapld:AdaPLDProposer",
    "dresd": "vllm_specplug.methods.dresd:DReSDProposer",
    "eagle3_tree": "vllm_specplug.methods.eagle3_tree:Eagle3TreeProposer",
}


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
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


# Names vLLM 0.32 owns; a plugin method may not shadow them.
_BUILTIN_VLLM_METHODS = frozenset(
    {"ngram", "ngram_gpu", "medusa", "mlp_speculator", "draft_model", "suffix",
     "custom_class", "eagle", "eagle3", "mtp", "extract_hidden_states", "dflash",
     "dspark"}
)
