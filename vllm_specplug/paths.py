"""Where vllm_specplug keeps what it builds on the user's machine (models,
compiled kernels): one folder, ``$SPECPLUG_CACHE`` or ``~/.cache/vllm_specplug``."""

from __future__ import annotations

import os


def default_cache_dir() -> str:
    """``$SPECPLUG_CACHE`` if set (and non-empty), else ``~/.cache/vllm_specplug``."""
    env = os.environ.get("SPECPLUG_CACHE")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm_specplug")
