"""The package's import arrows, read from the source (every import statement,
also the ones inside functions): ``vllm_specplug`` stands alone (no import
of the repository's ``benchmarks`` or ``tests``), kernels depend on nothing
above them, and no two modules import each other, directly or around a
circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_specplug"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, relative ones resolved."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _offending(in_module, bad) -> list[str]:
    """``file:line imports X`` for every import ``X`` with ``bad(X)`` in the
    modules with ``in_module(module name)``."""
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
            for module, path in _sources().items() if in_module(module)
            for line, imported in _imports(path) if bad(imported)]


def test_the_package_imports_neither_benchmarks_nor_tests():
    def repo_only(name: str) -> bool:
        return name.split(".")[0] in ("benchmarks", "tests")

    assert not _offending(lambda m: True, repo_only), (
        "vllm_specplug must work installed from a wheel, without the repository's "
        "benchmarks/ and tests/ (move what it needs into the package)")


def test_kernels_import_neither_runner_nor_models():
    def above_kernels(name: str) -> bool:
        return name.startswith(("vllm_specplug.runner", "vllm_specplug.models"))

    assert not _offending(lambda m: m.startswith("vllm_specplug.kernels"), above_kernels)


def test_no_import_circle():
    sources = _sources()
    graph = {m: {n for _, n in _imports(p) if n in sources and n != m}
             for m, p in sources.items()}
    done: set[str] = set()

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for nxt in sorted(graph[module]):
            found = circle_from(nxt, path + [module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        circle = circle_from(module, [])
        assert circle is None, "import circle: " + " -> ".join(circle)
