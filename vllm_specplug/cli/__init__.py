"""`specplug`: the command-line tools of vllm_specplug, as subcommands.

Each subcommand is a module of this package exposing
``register_cli(subparsers)``; it parses arguments and calls the code it
drives elsewhere in ``vllm_specplug``, importing that (and torch, vLLM)
only inside the command, so ``specplug --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules in the order their commands are listed (`models` registers both
# `ref-model` and `tiny-model`).
_SUBCOMMANDS = ("models", "serve", "methods", "adjacency", "datastore", "eagle3", "graft",
                "reader", "selftest")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="specplug", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Subcommand modules import their heavy dependencies inside the command
    # function, so registering all of them is cheap.
    for name in _SUBCOMMANDS:
        module = f"{__name__}.{name}"
        try:
            importlib.import_module(module).register_cli(sub)
        except Exception as e:  # one broken tool must not take the others down
            print(f"specplug: skipping {module}: {e}", file=sys.stderr)
    # `specplug serve` hands everything on to `vllm serve`, options first
    # included (argparse's REMAINDER only starts at a positional argument).
    args, unparsed = parser.parse_known_args(argv)
    if unparsed and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    args.unparsed = unparsed
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
