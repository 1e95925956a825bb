"""What ``specplug serve`` adds to vLLM's OpenAI server.

vLLM's server silently ignores request fields it does not know (a typo such
as ``"temprature"`` then samples greedily). :func:`reject_unknown_fields`, a
vLLM ``--middleware``, answers them with a 400 naming the field instead;
``specplug serve --allow-unknown-fields`` leaves it out.
"""

from __future__ import annotations

import json

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
