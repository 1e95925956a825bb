"""How result files are stored: JSON with each list item on a line of its own.

Indented JSON spends about a third of a result file on whitespace, and the
committed results live under a size cap (``tests/benchmarks/test_report.py``).
One compact line per record keeps the files small and their diffs readable
record by record; any JSON reader loads them as before.

``python -m benchmarks.result_file FILE...`` rewrites files in this form.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def dumps(doc: dict) -> str:
    """``doc`` as stored: a top-level key per line; a list's items one per
    line under it; everything else compact on its key's line."""
    entries = []
    for key, value in doc.items():
        head = f"{_compact(key)}:"
        if isinstance(value, list) and value:
            items = ",\n".join(_compact(item) for item in value)
            entries.append(f"{head}[\n{items}]")
        else:
            entries.append(head + _compact(value))
    return "{\n" + ",\n".join(entries) + "\n}\n"


def write(doc: dict, path: str | os.PathLike) -> None:
    """Write ``doc`` to ``path`` whole or not at all (a temporary file and
    a rename), creating its folder."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(doc))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.result_file",
                                 description="Rewrite result files in the stored form.")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        before = os.path.getsize(path)
        write(doc, path)
        print(f"{path}: {before} -> {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
