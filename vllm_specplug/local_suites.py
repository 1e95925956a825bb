"""Suites built from what every install has: real code and real
documentation, asked about the way users ask (``suites.load("code_edit")``,
``suites.load("doc_qa")``). Held out: nothing here tunes on them.

``code_edit``
    A function from Python's standard library (this interpreter's own
    source), with a small change to make: add type hints, a docstring, an
    argument check, rename it, ... The answer copies most of the function,
    as edits of a user's code do.
``doc_qa``
    A question answered from a long documentation page: the description
    (README) of an installed package, its first ``DOC_CHARS`` characters
    cut at a paragraph, and a question about it.

Both are deterministic for one Python version and one set of installed
packages (``scripts/setup.sh`` pins them); a package or module missing here
is skipped.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import itertools

from vllm_specplug.corpus import interleave

CODE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "heapq", "bisect", "colorsys",
                "calendar", "difflib", "statistics", "string", "csv", "base64", "quopri",
                "netrc", "mimetypes", "tokenize", "ipaddress", "fractions", "gettext")
"""Standard-library modules whose top-level functions are edited, in order."""

FUNCTION_LINES = (6, 40)
"""A function is taken when its source has this many lines (inclusive)."""

EDITS = (
    "Add type hints to this function's parameters and return value.",
    "Add a docstring to this function that explains each parameter.",
    "Rename this function to `{name}_v2`; keep everything else exactly the same.",
    "Make this function raise a ValueError with a clear message when its first "
    "argument is None.",
    "Rewrite this function to use f-strings wherever it formats a string; "
    "change nothing else.",
    "Add a short comment above each loop in this function saying what it does.",
)

DOC_PACKAGES = ("attrs", "cachetools", "charset-normalizer", "cloudpickle", "dill",
                "einops", "email-validator", "fastapi", "frozenlist", "h11", "httpcore",
                "idna", "jmespath", "loguru", "mpmath", "openai", "propcache", "psutil",
                "pybase64", "pycountry", "python-dateutil", "python-dotenv", "regex", "rich")
"""Installed packages whose description is the documentation page, in order."""

DOC_CHARS = 4000
DOC_MIN_CHARS = 2000
QUESTIONS = (
    "According to the documentation above, how do I install {name} and start using it?",
    "Which functions, classes or commands does the documentation above mention? "
    "List them with one line each on what they do.",
    "Summarize in three sentences what {name} is for, using only the documentation above.",
    "What does the documentation above say about options, configuration or limits?",
)


def code_edit_texts() -> list[str]:
    """Every edit prompt, one per function, the edits taken in turn; the
    modules take turns too (a limit spreads over them)."""
    texts = []
    functions = interleave(map(_functions, CODE_MODULES))
    for (module, name, source), edit in zip(functions, itertools.cycle(EDITS)):
        texts.append(f"Here is a function from Python's `{module}` module:\n\n"
                     f"```python\n{source}\n```\n\n{edit.format(name=name)} "
                     "Return the complete function.")
    return texts


def _functions(module: str) -> list[tuple[str, str, str]]:
    """``(module, name, source)`` of the module's top-level functions of
    ``FUNCTION_LINES`` lines, in file order."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    with open(spec.origin, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    out = []
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n = node.end_lineno - first + 1
        if FUNCTION_LINES[0] <= n <= FUNCTION_LINES[1]:
            out.append((module, node.name, "\n".join(lines[first - 1:node.end_lineno])))
    return out


def doc_qa_texts() -> list[str]:
    """Every page with each question in turn: first question round over all
    pages, then the next round (so a limit spreads over pages)."""
    pages = [(name, page) for name in DOC_PACKAGES if (page := _page(name))]
    texts = []
    for r in range(len(QUESTIONS)):
        for k, (name, page) in enumerate(pages):
            question = QUESTIONS[(k + r) % len(QUESTIONS)].format(name=name)
            texts.append(f"{page}\n\n---\n\n{question}")
    return texts


def _page(name: str) -> str | None:
    """The package's description, cut after whole paragraphs to at most
    ``DOC_CHARS`` characters; None if missing or short."""
    try:
        meta = importlib.metadata.metadata(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    body = (meta.get_payload() or meta.get("Description") or "").strip()
    if len(body) < DOC_MIN_CHARS:
        return None
    if len(body) <= DOC_CHARS:
        return body
    cut = body.rfind("\n\n", 0, DOC_CHARS)
    return body[:cut if cut > DOC_MIN_CHARS else DOC_CHARS].rstrip()
