"""Merge ``benchmarks.run`` files of one matrix that was split by method.

A long matrix is run as several ``benchmarks.run`` commands (e.g. one per
core, each with ``VLLM_CPU_OMP_THREADS_BIND`` set), each with its own
``none``. The merged file has every method's records once, the first file's
``none`` and ceilings, and ``run.command`` listing every command. It refuses
files whose settings differ (model, dtype, tokens, suites, batch sizes,
limit, N, mode) or whose ``none`` outputs differ (then the parts did not
decode the same prompts the same way and no record is comparable).

``python -m benchmarks.merge OUT.json PART.json [PART.json ...]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import report

SAME = ("model", "dtype", "max_tokens", "max_model_len", "num_speculative_tokens",
        "batch_sizes", "limit", "ignore_eos", "temperature", "enforce_eager")


class MergeError(ValueError):
    pass


def _none_outputs(doc: dict) -> dict:
    """Plain decoding's token counts and (with ``--save-outputs``) tokens."""
    return {(r["suite"], r["batch_size"]): (r.get("generated_tokens"), r.get("outputs"))
            for r in doc["records"] if r["method"] == "none"}


def merge(docs: list[dict]) -> dict:
    if not docs:
        raise MergeError("nothing to merge")
    first = docs[0]
    out = json.loads(json.dumps(first))
    run = out["run"]
    run["command"] = " ; ".join(d["run"]["command"] for d in docs)
    seen = {r["method"] for r in first["records"]}
    mine = _none_outputs(first)
    for i, d in enumerate(docs[1:], 2):
        for k in SAME:
            if d["run"].get(k) != run.get(k):
                raise MergeError(f"part {i} differs in run.{k}: {d['run'].get(k)!r} "
                                 f"vs {run.get(k)!r}")
        if [s.get("name") for s in d["run"]["suites"]] != [s.get("name") for s in run["suites"]]:
            raise MergeError(f"part {i} ran other suites")
        for key, (n, outs) in _none_outputs(d).items():
            if key not in mine:
                continue
            n0, outs0 = mine[key]
            if n != n0 or (outs is not None and outs0 is not None and outs != outs0):
                raise MergeError(f"part {i}: plain decoding differs on {key}")
        new = [r for r in d["records"] if r["method"] not in seen]
        out["records"].extend(new)
        seen |= {r["method"] for r in new}
        names = {m["name"] for m in run["methods"]}
        run["methods"] += [m for m in d["run"]["methods"] if m["name"] not in names]
        run["complete"] = run["complete"] and d["run"]["complete"]
        run["exit_code"] = max(run.get("exit_code") or 0, d["run"].get("exit_code") or 0)
        run["total_seconds"] = (run.get("total_seconds") or 0) + (d["run"].get("total_seconds") or 0)
        run["finished_at"] = max(run.get("finished_at") or "", d["run"].get("finished_at") or "")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    docs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args[1:]]
    try:
        doc = merge(docs)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    errors = report.validate(doc)
    if errors:
        print("error: merged file does not match the schema:\n  " + "\n  ".join(errors[:10]),
              file=sys.stderr)
        return 4
    Path(args[0]).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    try:
        report.plot(doc, str(Path(args[0]).with_suffix(".png")))
    except ImportError:
        pass
    print(report.table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
