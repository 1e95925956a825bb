"""ReSpec's relaxed verification (LOSSY): a sweep over its two margins.

``python -m benchmarks.studies.respec_relaxed [--taus 0,1,2,3,5] [--ms 1,2,3,4]
[--suite specbench:summarization] [--out benchmarks/results/respec_relaxed.json]``

runs ``benchmarks.run`` once with ``none``, strict ``respec`` and one
``respec@t{tau}-m{m}`` label per grid point (``relaxed_lossy: true``,
``relaxed_tau_nats`` = tau, ``relaxed_m`` = m, the other relaxed options at
their defaults), then plots, per m, tau (tokens per target pass) and the
match rate against plain decoding (the share of generated tokens before an
output's first divergence from ``none``: a quality proxy, 1.0 = lossless)
over the relaxed margin. ``--plot-only`` redraws from an existing JSON.
Other arguments (``--batch``, ``--limit``, ``--max-tokens``, ``--eager``...)
go to ``benchmarks.run`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import run
from benchmarks.figures import save_png


def grid_options(taus: list[float], ms: list[int], base: dict) -> dict[str, dict]:
    """``respec`` (strict) and one relaxed label per (tau, m)."""
    opts = {"respec": dict(base)}
    for m in ms:
        for t in taus:
            opts[f"respec@t{t:g}-m{m}"] = base | {
                "relaxed_lossy": True, "relaxed_tau_nats": t, "relaxed_m": m}
    return opts


def table(doc: dict) -> list[dict]:
    """One row per relaxed grid point (and strict ``respec``) and batch size."""
    options = {m["name"]: m["options"] for m in doc["run"]["methods"]}
    rows = []
    for r in doc["records"]:
        if not r["method"].startswith("respec") or r.get("status") != "ok":
            continue
        o = options[r["method"]]
        rows.append({"method": r["method"], "suite": r["suite"], "batch_size": r["batch_size"],
                     "relaxed": run.lossy_by_option(o),
                     "tau_nats": o.get("relaxed_tau_nats"), "m": o.get("relaxed_m"),
                     "tau": r["tau"], "token_match_rate": r["token_match_rate"],
                     "identical_fraction": r["identical_fraction"]})
    return rows


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = table(doc)
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(len(batches), 2, figsize=(11, 4 * len(batches)), squeeze=False)
    for (ax_tau, ax_match), b in zip(axes, batches):
        strict = [r for r in rows if r["batch_size"] == b and not r["relaxed"]]
        for m in sorted({r["m"] for r in rows if r["relaxed"]}):
            pts = sorted((r["tau_nats"], r["tau"], r["token_match_rate"])
                         for r in rows if r["batch_size"] == b and r["relaxed"] and r["m"] == m)
            ax_tau.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"m={m}")
            ax_match.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=f"m={m}")
        if strict:
            ax_tau.axhline(strict[0]["tau"], color="k", ls="--", label="strict respec")
            ax_match.axhline(1.0, color="k", ls="--", label="strict (lossless)")
        suite = rows[0]["suite"] if rows else ""
        ax_tau.set(xlabel="relaxed_tau_nats", ylabel="tau (tokens per target pass)",
                   title=f"{suite}, batch {b}")
        ax_match.set(xlabel="relaxed_tau_nats", ylabel="token match rate vs plain decoding",
                     title=f"LOSSY relaxed verification, batch {b}")
        for ax in (ax_tau, ax_match):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--taus", default="0,1,2,3,5")
    ap.add_argument("--ms", default="1,2,3,4")
    ap.add_argument("--suite", default="specbench:summarization")
    ap.add_argument("--num-speculative-tokens", default="16")
    ap.add_argument("--options", default='{"cost_aware": false}',
                    help="JSON options shared by every respec label")
    ap.add_argument("--out", default="benchmarks/results/respec_relaxed.json")
    ap.add_argument("--plot-only", action="store_true")
    args, rest = ap.parse_known_args(argv)
    out = Path(args.out)
    if not args.plot_only:
        opts = grid_options([float(t) for t in args.taus.split(",")],
                            [int(m) for m in args.ms.split(",")], json.loads(args.options))
        code = run.main(["--methods", ",".join(["none", *opts]), "--method-options",
                         json.dumps(opts), "--suites", args.suite, "--num-speculative-tokens",
                         args.num_speculative_tokens, "--dtype", "float32", "--no-plot",
                         "--out", str(out), *rest])
        if code != 0:
            return code
    doc = json.loads(out.read_text())
    for r in table(doc):
        print(f"{r['method']:22s} b{r['batch_size']}  tau {r['tau']:.2f}  "
              f"match {r['token_match_rate']:.3f}  identical {r['identical_fraction']:.2f}")
    plot(doc, str(out.with_suffix(".png")))
    print(f"plot: {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
