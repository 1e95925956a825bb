"""`specplug`: every command-line tool of the project, as subcommands.

Each subcommand lives next to the code it drives and exposes
``register_cli(subparsers)``; modules are imported only when needed so
``specplug --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "ref-model": "vllm_specplug.models.cli",
    "serve": "vllm_specplug.serve_cli",
    "methods": "vllm_specplug.methods.cli",
    "adjacency": "vllm_specplug.sources.adjacency_cli",
    "datastore": "vllm_specplug.datastore.cli",
    "eagle3": "vllm_specplug.eagle3.cli",
    "graft": "vllm_specplug.methods.graft_calibrate",
    "reader": "vllm_specplug.methods.reader_cli",
    "selftest": "vllm_specplug.selftest",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="specplug", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Subcommand modules import their heavy dependencies inside the command
    # function, so registering all of them is cheap.
    for module in dict.fromkeys(_SUBCOMMANDS.values()):
        try:
            importlib.import_module(module).register_cli(sub)
        except Exception as e:  # one broken tool must not take the others down
            print(f"specplug: skipping {module}: {e}", file=sys.stderr)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
