"""Plots and a Markdown table of a serving sweep's JSON
(:mod:`benchmarks.serve_sweep`).

    python -m benchmarks.serve_report benchmarks/results/serve_sweep.json

- :func:`plot_all`: one PNG per dataset and temperature: output tokens/s,
  p50 TPOT and p99 TPOT against max concurrency (top row) and against the
  Poisson request rate (bottom row), one line per method;
- :func:`render_markdown`: per dataset and temperature, each method's output
  tokens/s and p99 TPOT at every load point, with its ratio to plain
  decoding (``none``) beside it, and tau.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys

from benchmarks.figures import save_png

PANELS = (("output_throughput", None, "output tokens/s"),
          ("tpot_ms", "p50", "p50 TPOT (ms)"), ("tpot_ms", "p99", "p99 TPOT (ms)"))
BASELINE = "none"
NOT_SPECULATING = ("plain", "oracle")
"""Specplug engines that draft nothing: held to the 0.97x floor, never the
best specplug method."""


def _value(rec: dict, key: str, sub: str | None):
    v = rec.get(key)
    return v.get(sub) if sub and isinstance(v, dict) else v


MEDIAN_FIGURES = (("output_throughput", None), ("request_throughput", None),
                  *((k, s) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
                    for s in ("mean", "p50", "p99")))
"""The figures a point measured in several passes reports as their median."""


def median_record(passes: list[dict]) -> dict:
    """One load point measured in several passes (each its own server, see
    ``serve_sweep --repeats``) as one record: every figure the median over
    the passes, ``passes`` their number, ``output_throughput_range`` the
    min and max output tokens/s, tau the median of the passes' taus."""
    if len(passes) == 1:
        return passes[0]
    rec = copy.deepcopy(passes[0])
    rec["passes"] = len(passes)
    for key, sub in MEDIAN_FIGURES:
        values = [v for v in (_value(r, key, sub) for r in passes) if v is not None]
        if not values:
            continue
        if sub is None:
            rec[key] = statistics.median(values)
        else:
            rec[key][sub] = statistics.median(values)
    tps = [r["output_throughput"] for r in passes if r.get("output_throughput") is not None]
    rec["output_throughput_range"] = [min(tps), max(tps)] if tps else None
    taus = [t for t in ((r.get("spec") or {}).get("tau") for r in passes) if t is not None]
    if taus:
        rec["spec"]["tau"] = statistics.median(taus)
    rec["completed"] = sum(r.get("completed") or 0 for r in passes)
    rec["failed"] = sum(r.get("failed") or 0 for r in passes)
    return rec


def groups(doc: dict) -> dict[tuple[str, float], list[dict]]:
    """Records by (dataset, temperature), in the order they were measured,
    a point measured in several passes as one (``median_record``)."""
    points: dict[tuple, list[dict]] = {}
    for rec in doc.get("records", []):
        key = (rec["dataset"], rec["temperature"], rec["method"], rec["load"], rec["value"])
        points.setdefault(key, []).append(rec)
    out: dict[tuple[str, float], list[dict]] = {}
    for (dataset, temp, *_), passes in points.items():
        out.setdefault((dataset, temp), []).append(median_record(passes))
    return out


def series(recs: list[dict], load: str, key: str, sub: str | None) -> dict[str, list]:
    """method -> sorted [(load value, figure)] of the records at ``load``."""
    out: dict[str, list] = {}
    for r in recs:
        v = _value(r, key, sub)
        if r["load"] == load and v is not None:
            out.setdefault(r["method"], []).append((r["value"], v))
    return {m: sorted(pts) for m, pts in out.items()}


def plot_group(recs: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [ld for ld in ("concurrency", "rate") if any(r["load"] == ld for r in recs)]
    fig, axes = plt.subplots(len(loads), len(PANELS), squeeze=False,
                             figsize=(5 * len(PANELS), 4 * len(loads)))
    for row, load in enumerate(loads):
        for col, (key, sub, label) in enumerate(PANELS):
            ax = axes[row][col]
            for method, pts in series(recs, load, key, sub).items():
                xs, ys = zip(*pts)
                style = "k--" if method == BASELINE else "-o"
                ax.plot(xs, ys, style, label=method, markersize=3)
            if load == "concurrency":
                ax.set_xscale("log", base=2)
                ticks = sorted({r["value"] for r in recs if r["load"] == load})
                ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
                ax.minorticks_off()
            ax.set_xlabel("max concurrency" if load == "concurrency" else "request rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def plot_path(prefix: str, dataset: str, temp: float) -> str:
    """Where :func:`plot_all` writes one group's plot."""
    return f"{prefix}_{dataset.replace(':', '-')}_t{temp:g}.png"


def plot_all(doc: dict, prefix: str) -> list[str]:
    """Write ``<prefix>_<dataset>_t<temperature>.png`` per group; the paths."""
    paths = []
    model = doc.get("run", {}).get("model", "")
    for (dataset, temp), recs in groups(doc).items():
        path = plot_path(prefix, dataset, temp)
        plot_group(recs, f"{dataset}, temperature {temp:g} ({model.rsplit('/', 1)[-1]})", path)
        paths.append(path)
    return paths


def _cell(rec: dict, base: dict | None) -> str:
    tps, p99 = rec.get("output_throughput"), _value(rec, "tpot_ms", "p99")
    if tps is None or p99 is None:
        return "-"
    spread = rec.get("output_throughput_range")
    text = f"{tps:.1f}" + (f" [{spread[0]:.1f}-{spread[1]:.1f}]" if spread else "")
    text += f" / {p99:.0f}"
    tps_ratio = ratio(rec, base, "output_throughput")
    tpot_ratio = ratio(rec, base, "tpot_ms", "p99")
    if base is not rec and tps_ratio is not None and tpot_ratio is not None:
        text += f" ({tps_ratio:.2f}x / {tpot_ratio:.2f}x)"
    tau = (rec.get("spec") or {}).get("tau")
    return text + (f", tau {tau:.2f}" if tau else "")


def load_label(load: str, value: float) -> str:
    return f"c={value:g}" if load == "concurrency" else f"{value:g} req/s"


def render_markdown(doc: dict, baseline: str = BASELINE) -> str:
    """One table per dataset and temperature: rows are methods, columns load
    points; a cell is ``output tok/s / p99 TPOT ms`` (medians, with the
    tokens/s' min-max in brackets, where a point ran in several passes;
    ratio to
    ``baseline``: ``none``, or ``plain`` for speculation apart from the
    plugin's CPU kernel), and tau (tokens per verified draft)."""
    lines = []
    for (dataset, temp), recs in groups(doc).items():
        cols = list(dict.fromkeys((r["load"], r["value"]) for r in recs))
        base = {(r["load"], r["value"]): r for r in recs if r["method"] == baseline}
        lines += [f"**{dataset}, temperature {temp:g}** (output tok/s / p99 TPOT ms; "
                  f"ratio to `{baseline}`)", "",
                  "| method | " + " | ".join(load_label(*c) for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for method in dict.fromkeys(r["method"] for r in recs):
            by = {(r["load"], r["value"]): r for r in recs if r["method"] == method}
            cells = [_cell(by[c], base.get(c)) if c in by else "-" for c in cols]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def ratio(rec: dict, base: dict | None, key: str, sub: str | None = None) -> float | None:
    a, b = _value(rec, key, sub), _value(base, key, sub) if base else None
    return a / b if a is not None and b else None


def method_kinds(doc: dict) -> dict[str, str]:
    """Each method of a sweep -> ``specplug`` / ``vllm`` / ``baseline``."""
    return {r["method"]: r.get("method_kind") for r in doc.get("records", [])}


def targets(doc: dict) -> list[str]:
    """The serving targets the sweep is held to, one line per miss (empty:
    all met).

    Every specplug method at every point: output tokens/s at least 0.97x
    ``none``'s and p99 TPOT at most 1.03x; the best specplug method at
    concurrency 1 at least 1.3x ``none``, and ahead of vLLM's ``suffix``
    and ``ngram`` at every concurrency (the best of those that draft:
    ``NOT_SPECULATING`` left out)."""
    misses, kinds = [], method_kinds(doc)
    for (dataset, temp), recs in groups(doc).items():
        at = {(r["method"], r["load"], r["value"]): r for r in recs}
        where = f"{dataset} T={temp:g}"
        for r in recs:
            if kinds.get(r["method"]) != "specplug":
                continue
            base = at.get((BASELINE, r["load"], r["value"]))
            tps, tpot = ratio(r, base, "output_throughput"), ratio(r, base, "tpot_ms", "p99")
            label = f"{where} {load_label(r['load'], r['value'])} {r['method']}"
            if tps is not None and tps < 0.97:
                misses.append(f"{label}: output tok/s {tps:.2f}x none (< 0.97x)")
            if tpot is not None and tpot > 1.03:
                misses.append(f"{label}: p99 TPOT {tpot:.2f}x none (> 1.03x)")
        for c in sorted({r["value"] for r in recs if r["load"] == "concurrency"}):
            ours = [r for r in recs if r["load"] == "concurrency" and r["value"] == c
                    and kinds.get(r["method"]) == "specplug" and r.get("output_throughput")
                    and r["method"] not in NOT_SPECULATING]
            if not ours:
                continue
            best = max(ours, key=lambda r: r["output_throughput"])
            base = at.get((BASELINE, "concurrency", c))
            gain = ratio(best, base, "output_throughput")
            if c == 1 and gain is not None and gain < 1.3:
                misses.append(f"{where} c=1: best specplug ({best['method']}) {gain:.2f}x "
                              "none (< 1.3x)")
            for rival in ("suffix", "ngram"):
                other = at.get((rival, "concurrency", c))
                if other and (other.get("output_throughput") or 0) >= best["output_throughput"]:
                    misses.append(f"{where} c={c:g}: {rival} {other['output_throughput']:.1f} "
                                  f">= best specplug ({best['method']}) "
                                  f"{best['output_throughput']:.1f} tok/s")
    return misses


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.serve_report SWEEP.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    print(render_markdown(doc))
    if any(r["method"] == "plain" for r in doc.get("records", [])):
        print(render_markdown(doc, baseline="plain"))
    misses = targets(doc)
    print("targets: " + ("all met" if not misses else f"{len(misses)} missed"))
    for line in misses:
        print(f"- {line}")
    for path in plot_all(doc, argv[0].rsplit(".", 1)[0]):
        print(f"plot: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
