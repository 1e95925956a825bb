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

import os

__all__ = ["shipped_head_path"]

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")


def shipped_head_path(name: str = "smollm2-135m-instruct") -> str:
    """Folder of a head shipped with the package (``config.json`` +
    ``model.safetensors``), for ``{"method": "eagle3", "model": <this>}``."""
    path = os.path.join(HEADS_DIR, name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"no shipped EAGLE-3 head {name!r} in {HEADS_DIR}")
    return path
