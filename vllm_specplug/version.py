"""The vLLM release this plugin is built and tested against."""

from __future__ import annotations

import os

TESTED_VLLM = "0.32.0"
_ALLOW_ENV = "SPECPLUG_ALLOW_ANY_VLLM"


def check_vllm_version() -> None:
    """Fail in one line on another vLLM (the runner layer overrides private
    methods whose contracts change between releases)."""
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if found.split("+")[0] == TESTED_VLLM:
        return
    msg = (
        f"vllm-specplug is tested on vLLM {TESTED_VLLM} only, found {found}; "
        f"set {_ALLOW_ENV}=1 to try anyway"
    )
    if os.environ.get(_ALLOW_ENV) == "1":
        from vllm.logger import init_logger

        init_logger(__name__).warning(msg)
        return
    raise RuntimeError(msg)
