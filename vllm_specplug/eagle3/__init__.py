"""EAGLE-3 draft heads for vLLM's built-in ``eagle3`` method.

* :mod:`.data`: the target's own responses (vLLM) and its aux-layer hidden
  states (transformers), in resumable safetensors shards;
* :mod:`.model`: the head in torch (fc + one decoder layer + norm + lm_head,
  optional reduced draft vocabulary) and its vLLM checkpoint format;
* :mod:`.train`: the EAGLE-3 training-time-test recipe on CPU;
* :mod:`.cli`: ``specplug eagle3 generate-data|train``.

Shipped heads live in ``heads/<target>/`` (see :func:`shipped_head_path`).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["TARGET_MATCH_KEYS", "default_head_for", "shipped_head_path", "target_config"]

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")


def shipped_head_path(name: str = "smollm2-135m-instruct") -> str:
    """Folder of a head shipped with the package (``config.json`` +
    ``model.safetensors``), for ``{"method": "eagle3", "model": <this>}``."""
    path = os.path.join(HEADS_DIR, name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"no shipped EAGLE-3 head {name!r} in {HEADS_DIR}")
    return path


# what a head records about its target (``target_config`` in its training
# record) and what must match for it to be a target's default head
TARGET_MATCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


def target_config(target: str) -> dict[str, Any]:
    """A target folder's ``config.json`` (the language model's part of a
    multimodal wrapper)."""
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    # multimodal wrappers keep the language model under text_config
    return cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg


def default_head_for(model: str) -> str | None:
    """The shipped head whose recorded target has the shape of ``model`` (a
    local Hugging Face folder), or None. A head trained for another model of
    the same shape stays lossless (vLLM verifies every draft), it only
    accepts less, so the shape is enough to pick a default."""
    try:
        target = target_config(model)
    except (OSError, ValueError, TypeError):
        return None
    if not os.path.isdir(HEADS_DIR):
        return None
    for name in sorted(os.listdir(HEADS_DIR)):
        meta_path = os.path.join(HEADS_DIR, name, "specplug_eagle3.json")
        try:
            with open(meta_path, encoding="utf-8") as f:
                recorded = json.load(f).get("target_config", {})
        except (OSError, ValueError):
            continue
        if recorded and all(recorded.get(k) == target.get(k) for k in TARGET_MATCH_KEYS):
            if os.path.exists(os.path.join(HEADS_DIR, name, "model.safetensors")):
                return os.path.join(HEADS_DIR, name)
    return None
