"""Outputs of the benchmark harness: schema validation, tables, plots; without
arguments, RESULTS.md and the docs' generated blocks (``benchmarks.results_md``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.figures import save_png
from benchmarks.machine import describe

SCHEMA_PATH = Path(__file__).with_name("schema.json")


def load_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate(doc: dict) -> list[str]:
    """Schema errors of ``doc`` (empty: valid). Needs ``jsonschema`` (a vLLM
    dependency); without it, returns a single note and does not fail."""
    try:
        import jsonschema
    except ImportError:
        return []
    cls = jsonschema.validators.validator_for(load_schema())
    validator = cls(load_schema())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))]


def tau(generated: int | None, accepted: int | None) -> float | None:
    """Tokens per target pass per request: generated / (generated - accepted).

    Every target pass of a request yields one token of its own plus the
    drafts it accepted, so a request's passes are ``generated - accepted``
    (its prefill pass included) and ``tau`` is what Spec-Bench and the papers
    compare. Unlike vLLM's mean accepted length (``1 + accepted / drafts``),
    it counts the passes where a method drafted nothing. Pooled over a suite
    (sums of tokens and of accepted drafts), it weighs requests by length.
    Plain decoding (no accepted tokens) has ``tau = 1``. vLLM counts a step's
    accepted drafts before cutting the output at a stop or ``max_tokens``, so
    the last pass of a request can add up to ``k`` accepted tokens that were
    not kept: ``tau`` is then a slight overestimate. None without counts.
    """
    if generated is None:
        return None
    passes = generated - (accepted or 0)
    return generated / passes if passes > 0 else None


def draft_rate(drafts: int | None, generated: int | None,
               accepted: int | None) -> float | None:
    """Drafts per target pass per request: how often a method drafted at all
    (vLLM's ``num_drafts`` over the passes ``tau`` counts). A mean accepted
    length is only comparable between methods next to this rate."""
    if drafts is None or generated is None:
        return None
    passes = generated - (accepted or 0)
    return drafts / passes if passes > 0 else None


def record_tau(rec: dict) -> float | None:
    """A record's ``tau`` (computed from its counters for files written
    before the field existed; 1.0 for plain decoding)."""
    if rec.get("tau") is not None:
        return rec["tau"]
    if rec.get("status") != "ok":
        return None
    return tau(rec.get("generated_tokens"), rec.get("accepted_tokens"))


def record_draft_rate(rec: dict) -> float | None:
    if rec.get("draft_rate") is not None:
        return rec["draft_rate"]
    if rec.get("status") != "ok":
        return None
    return draft_rate(rec.get("drafts"), rec.get("generated_tokens"), rec.get("accepted_tokens"))


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def identical_cell(rec: dict) -> str:
    if rec["status"] != "ok":
        return rec["status"].upper()
    if rec["identical"] is None:
        return "n/a"
    if rec["identical"]:
        return "yes"
    return (f"NO ({rec['identical_fraction']:.0%} out, "
            f"{rec['token_match_rate']:.0%} tok)")


def min_max(rec: dict, name: str) -> str:
    """``rec``'s ``name``_min–``name``_max (``-`` without several passes)."""
    lo, hi = rec.get(f"{name}_min"), rec.get(f"{name}_max")
    if lo is None or hi is None or (rec.get("passes") or 0) < 2:
        return "-"
    return f"{lo:.2f}-{hi:.2f}"


def table(doc: dict) -> str:
    """The human-readable table: one line per record, grouped by batch size."""
    head = (f"{'method':<10} {'suite':<26} {'B':>3} {'tau':>5} {'spec-x':>6} "
            f"{'min-max':>9} {'speedup':>7} {'kernel':>6} {'draft%':>6} {'n':>2} "
            f"{'tok/s':>8} {'MAL':>5} {'ceil-p':>6} {'ceil+p':>6} {'prop%':>6} "
            f"{'peakMiB':>8}  identical")
    lines = [f"mode: {run_mode(doc)}; {describe(doc['run'].get('machine') or {})}"]
    for b in doc["run"]["batch_sizes"]:
        lines.append(f"\n== batch size {b} ==")
        lines.append(head)
        lines.append("-" * len(head))
        recs = [r for r in doc["records"] if r["batch_size"] == b]
        done: set[str] = set()
        for r in recs:
            mine = [x for x in recs if x["method"] == r["method"]]
            if (len(mine) > 1 and all(x["status"] != "ok" for x in mine)
                    and len({(x["status"], x["reason"]) for x in mine}) == 1):
                # A method that did not run: one line for all its suites.
                if r["method"] not in done:
                    done.add(r["method"])
                    lines.append(f"{r['method']:<10} {'(all suites)':<26} {b:>3}  "
                                 f"{r['status'].upper()}: {r['reason']}")
                continue
            share = r["proposer_time_share"]
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            rate = record_draft_rate(r)
            lines.append(
                f"{r['method']:<10} {r['suite'][:26]:<26} {b:>3} "
                f"{_fmt(record_tau(r), '5.2f'):>5} "
                f"{_fmt(r.get('speculation_speedup'), '5.2f'):>6} "
                f"{min_max(r, 'speculation_speedup'):>9} {speed:>7} "
                f"{_fmt(r.get('kernel_speedup'), '5.2f'):>6} "
                f"{_fmt(None if rate is None else 100 * rate, '6.1f'):>6} "
                f"{_fmt(r.get('passes'), '2d'):>2} "
                f"{_fmt(r['tokens_per_s'], '8.1f'):>8} "
                f"{_fmt(r['mean_accepted_length'], '5.2f'):>5} "
                f"{_fmt(r['self_repetition'], '6.2f'):>6} "
                f"{_fmt(r['self_repetition_with_prompt'], '6.2f'):>6} "
                f"{_fmt(None if share is None else 100 * share, '6.1f'):>6} "
                f"{_fmt(r['peak_memory_mib'], '8.0f'):>8}  {identical_cell(r)}"
                + (f"  ({r['reason']})" if r["status"] != "ok" and r["reason"] else ""))
    lines.append(
        "\ntau: tokens per target pass per request, generated / (generated - accepted). "
        "spec-x: speculation speedup, tokens/s over `plain` (the plugin's engine drafting "
        "nothing; vLLM's own methods: over `none`), median of the passes, min-max beside it. "
        "speedup: over `none` (stock vLLM). kernel: `plain` over `none`, what the plugin's CPU "
        "linear kernel earns without speculation. n: timed passes. MAL: mean accepted length 1 + accepted/drafts (vLLM counters), which leaves out "
        "the passes without a draft; draft%: drafts per target pass. ceil-p / ceil+p: "
        "READER self-repetition of the `none` outputs without / with the prompt. "
        "prop%: proposer time / wall time (specplug methods).")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The run as Markdown: per batch size, one row per method and one column
    per suite, ``tau / tok/s (speedup, speculation speedup) / mean accepted
    length (draft rate)``,
    then whether every output was identical to ``none``; the self-repetition
    ceiling as a last row. Methods compare on ``tau`` (first): a mean accepted
    length alone flatters a method that rarely drafts."""
    suites = list(dict.fromkeys(r["suite"] for r in doc["records"]))
    out = []
    mode = run_mode(doc)
    for b in doc["run"]["batch_sizes"]:
        recs = {(r["method"], r["suite"]): r for r in doc["records"] if r["batch_size"] == b}
        methods = list(dict.fromkeys(m for m, _ in recs))
        out.append(f"**batch {b}** ({mode}): tau, tokens per target pass / tokens/s "
                   "(speedup vs none, speculation speedup vs plain) / mean accepted "
                   "length (drafts per pass)\n")
        out.append("| method | " + " | ".join(suites) + " | identical |")
        out.append("|---" * (len(suites) + 2) + "|")
        for m in methods:
            cells, same = [], []
            for su in suites:
                r = recs.get((m, su))
                if r is None:
                    cells.append("")
                    continue
                if r["status"] != "ok":
                    cells.append(r["status"])
                    continue
                spec = r.get("speculation_speedup")
                cell = (f"{_fmt(record_tau(r), '.2f')} / {r['tokens_per_s']:.1f} "
                        f"({_fmt(r['speedup'], '.2f')}x"
                        + ("" if spec is None else f", speculation {spec:.2f}x") + ")")
                if r["mean_accepted_length"] is not None:
                    rate = record_draft_rate(r)
                    cell += f" / {r['mean_accepted_length']:.2f}"
                    if rate is not None:
                        cell += f" ({rate:.0%})"
                cells.append(cell)
                same.append(identical_cell(r))
            ident = "yes" if same and all(x == "yes" for x in same) else ", ".join(
                sorted(set(same))) or "-"
            out.append(f"| {m} | " + " | ".join(cells) + f" | {ident} |")
        out += ceiling_row(doc, b, suites, " | |")
        out.append("")
    out.append(describe(doc["run"].get("machine") or {}))
    return "\n".join(out)


def ceiling_row(doc: dict, batch: int, suites: list[str], tail: str) -> list[str]:
    """The self-repetition ceilings of ``batch`` as one Markdown row (none
    without ceilings): without / with the prompt, and with a datastore when
    the run had ``--ceiling-datastore``."""
    ceil = {c["suite"]: c for c in doc.get("ceilings", []) if c["batch_size"] == batch}
    if not ceil:
        return []
    ds = any("self_repetition_with_datastore" in c for c in ceil.values())
    return ["| *ceiling* (self-repetition, without / with prompt"
            + (" / with prompt + datastore" if ds else "") + ") | " + " | ".join(
                f"{_fmt(ceil[su]['self_repetition'], '.2f')} / "
                f"{_fmt(ceil[su]['self_repetition_with_prompt'], '.2f')}"
                + (f" / {_fmt(ceil[su].get('self_repetition_with_datastore'), '.2f')}"
                   if ds else "")
                if su in ceil else "" for su in suites) + tail]


def tau_markdown(doc: dict, ref: str) -> str:
    """Tau only, each cell beside its ratio to method ``ref``'s tau on the
    same suite and batch size (how a method is compared with its baseline), a
    last column with the mean over suites, then whether every output was
    identical to ``none``."""
    suites = list(dict.fromkeys(r["suite"] for r in doc["records"]))
    out = []
    for b in doc["run"]["batch_sizes"]:
        recs = {(r["method"], r["suite"]): r for r in doc["records"] if r["batch_size"] == b}
        methods = [m for m in dict.fromkeys(m for m, _ in recs) if m != "none"]
        out.append(f"**batch {b}** ({run_mode(doc)}, "
                   f"k={doc['run']['num_speculative_tokens']}): tau (x {ref})\n")
        out.append("| method | " + " | ".join(s.split(":")[-1] for s in suites)
                   + " | mean | identical |")
        out.append("|---" * (len(suites) + 3) + "|")
        for m in methods:
            cells, taus, same = [], [], []
            for su in suites:
                r, base = recs.get((m, su)), recs.get((ref, su))
                t = None if r is None or r["status"] != "ok" else record_tau(r)
                if t is None:
                    cells.append("" if r is None else r["status"])
                    continue
                taus.append(t)
                same.append(identical_cell(r))
                t0 = None if base is None or base["status"] != "ok" else record_tau(base)
                cells.append(f"{t:.2f}" if m == ref or not t0 else f"{t:.2f} ({t / t0:.2f}x)")
            ident = "yes" if same and all(x == "yes" for x in same) else ", ".join(
                sorted(set(same))) or "-"
            mean = f"{sum(taus) / len(taus):.2f}" if taus else "-"
            out.append(f"| {m} | " + " | ".join(cells) + f" | {mean} | {ident} |")
        out += ceiling_row(doc, b, suites, " | | |")
        out.append("")
    out.append(describe(doc["run"].get("machine") or {}))
    return "\n".join(out)


def run_mode(doc: dict) -> str:
    """``compiled`` or ``eager`` (runs before the field existed were eager)."""
    return "eager" if doc["run"].get("enforce_eager", True) else "compiled"


def main(argv: list[str] | None = None) -> int:
    """Without arguments: write benchmarks/RESULTS.md and the generated blocks
    of README.md and docs/ from the canonical result files. With a result
    file: print it (a table, ``--markdown``, or ``--tau-vs METHOD``)."""
    import argparse
    import inspect

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.report", description=inspect.cleandoc(main.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", help="one benchmarks.run JSON to print")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming every generated file that is stale")
    ap.add_argument("--markdown", action="store_true", help="print the run as Markdown tables")
    ap.add_argument("--tau-vs", metavar="METHOD", default=None,
                    help="Markdown table of tau only, with each cell's ratio to METHOD's")
    args = ap.parse_args(argv)
    if args.results is None:
        return _generate(check=args.check)
    doc = json.loads(Path(args.results).read_text(encoding="utf-8"))
    if args.tau_vs:
        print(tau_markdown(doc, args.tau_vs))
    else:
        print(markdown(doc) if args.markdown else table(doc))
    return 0


def _generate(check: bool) -> int:
    from benchmarks import results_md

    root = results_md.C.REPO_ROOT
    if check:
        stale = results_md.stale()
        for path in stale:
            print(f"stale: {path.relative_to(root)} (run: python -m benchmarks.report)")
        return 1 if stale else 0
    for path in results_md.write():
        print(f"wrote {path.relative_to(root)}")
    return 0


PLOT_PANELS = (("tau", "tau, tokens per target pass"),
               ("speculation_speedup", "speculation speedup vs plain"),
               ("speedup", "speedup vs none (plain's bar: the kernel)"))


def plot(doc: dict, path: str) -> None:
    """Tau (tokens per target pass), speculation speedup and speedup per
    suite (one row per batch size); the tau panel marks the self-repetition ceilings (tokens per
    pointer advance: the tau that copying could reach)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = doc["run"]["batch_sizes"]
    recs = [r for r in doc["records"] if r["status"] == "ok"]
    suites = [s["name"] for s in doc["run"]["suites"] if s["available"]]
    methods = [m["name"] for m in doc["run"]["methods"]]
    height = 3.6 * len(batches) + 0.6
    fig, axes = plt.subplots(len(batches), len(PLOT_PANELS),
                             figsize=(max(12, 3.3 * len(suites) + 6), height), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    legend: dict = {}
    for row, b in enumerate(batches):
        for col, (key, label) in enumerate(PLOT_PANELS):
            ax = axes[row][col]
            def value(r, key=key):
                return record_tau(r) if key == "tau" else r.get(key)

            shown = [m for m in methods if m != "none" and any(
                r["method"] == m and r["batch_size"] == b and value(r) is not None
                for r in recs)]
            width = 0.8 / max(1, len(shown))
            for i, m in enumerate(shown):
                vals = []
                for s in suites:
                    hit = [r for r in recs if r["method"] == m and r["suite"] == s
                           and r["batch_size"] == b]
                    vals.append(value(hit[0]) if hit and value(hit[0]) is not None else 0.0)
                xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(suites))]
                ax.bar(xs, vals, width, label=m,
                       color=colors[methods.index(m) % len(colors)])
            if key != "tau":
                ax.axhline(1.0, color="black", lw=0.8, ls="--")
            else:
                for j, s in enumerate(suites):
                    c = [x for x in doc["ceilings"] if x["suite"] == s and x["batch_size"] == b]
                    if not c:
                        continue
                    for v, style, lab in ((c[0]["self_repetition"], "--", "ceiling w/o prompt"),
                                          (c[0]["self_repetition_with_prompt"], "-",
                                           "ceiling with prompt")):
                        if v is not None:
                            ax.hlines(v, j - 0.45, j + 0.45, colors="black", linestyles=style,
                                      label=lab if j == 0 else None)
            ax.set_xticks(range(len(suites)))
            ax.set_xticklabels(suites, rotation=20, ha="right", fontsize=8)
            ax.set_title(f"{label}, batch {b}", fontsize=10)
            for h, lab in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(lab, h)
    run = doc["run"]
    fig.suptitle(f"{Path(run['model']).name} {run['dtype']}, max_tokens {run['max_tokens']}, "
                 f"k={run['num_speculative_tokens']}", fontsize=10)
    fig.legend(legend.values(), legend.keys(), loc="lower center",
               ncol=min(8, max(1, len(legend))), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.5 + 0.25 * ((len(legend) - 1) // 8)) / height, 1, 1))
    save_png(fig, path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
