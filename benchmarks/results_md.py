"""Render ``benchmarks/RESULTS.md`` and the generated blocks of the docs.

``python -m benchmarks.report`` writes both; ``--check`` compares them. A
generated block in README.md or docs/**/*.md is the text between

    <!-- BEGIN generated: benchmarks.report summary -->
    (or: method NAME, isolation, auto, versus, serving)
    <!-- END generated -->

and only that text is replaced; everything else in the file stays byte for byte.
"""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

from benchmarks import canonical as C
from benchmarks.report import record_draft_rate, record_tau, run_mode

COMMAND = "python -m benchmarks.report"
BLOCK = re.compile(r"(<!-- BEGIN generated: benchmarks\.report "
                   r"(summary|isolation|auto|versus|serving|method ([\w@.-]+)) -->\n)"
                   r"(.*?)(<!-- END generated -->)", re.S)
SPEEDUP_NOTE = (
    "Speedups are against stock vLLM plain decoding (`none`). The specplug engines also "
    "run the plugin's CPU linear kernel, so a specplug speedup mixes speculation with that "
    "kernel; tau (tokens per target pass) is the speculation figure.")


SPECULATION_NOTE = (
    "Speculation speedups are against `plain`, the plugin's engine drafting nothing, in "
    "the same run (vLLM's built-ins run stock: against `none`); speedups are against stock "
    "vLLM plain decoding (`none`) and include the plugin's CPU linear kernel, whose own "
    "gain is `plain`'s speedup.")


def _f(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _rel(target: Path, from_file: Path) -> str:
    return Path(os.path.relpath(target, from_file.parent)).as_posix()


# ------------------------------------------------------------- cells
def speedup_estimate(rec: dict) -> tuple[float | None, str, str]:
    """(speedup, its min–max, how it was estimated) of one record."""
    if rec["method"] == "none" or rec.get("method_kind") == "baseline":
        return 1.0, "", "reference"
    if "passes" in rec:  # the one estimator: every cell's median over its passes
        n = rec["passes"]
        how = (f"{'paired' if rec.get('paired_speedup_repeats') else 'unpaired'}, "
               f"median of {n} pass{'es' if n != 1 else ''}"
               + (", fresh engine per pass" if rec.get("fresh_engine_per_pass") else ""))
        return rec["speedup"], _spread(rec, "speedup"), how
    ratios = rec.get("paired_speedup_repeats") or []
    walls = rec.get("wall_seconds_repeats") or []
    first = rec.get("speedup_from") == "first repeat"
    if ratios:
        how = ("paired, first repeat only (remembers outputs)" if first
               else f"paired, median of {len(ratios)} repeats" if len(ratios) > 1
               else "paired, 1 repeat")
    elif len(walls) > 1 and not first:
        how = f"unpaired, median of {len(walls)} repeats"
    else:
        how = "unpaired, 1 repeat" + (" (remembers outputs)" if first else "")
    spread = f"{min(ratios):.2f}–{max(ratios):.2f}" if len(ratios) > 1 else ""
    return rec["speedup"], spread, how


def _spread(rec: dict, name: str) -> str:
    lo, hi = rec.get(f"{name}_min"), rec.get(f"{name}_max")
    return "" if lo is None or hi is None or rec.get("passes", 1) < 2 else f"{lo:.2f}–{hi:.2f}"


NOT_MEASURED = "—"
"""A figure the file's format does not have (speculation and kernel speedups
before ``schema_version`` 2)."""


def speculation_cells(rec: dict) -> tuple[str, str, str]:
    """(speculation speedup, its min–max, kernel speedup) of one record."""
    if "speculation_speedup" not in rec:
        return NOT_MEASURED, "", NOT_MEASURED
    spec = rec["speculation_speedup"]
    return (_f(spec) + ("x" if spec is not None else ""), _spread(rec, "speculation_speedup"),
            _f(rec.get("kernel_speedup")) + ("x" if rec.get("kernel_speedup") else ""))


def _identical(rec: dict) -> str:
    if rec["identical"] is None:
        return "–"
    if rec["identical"]:
        return "yes"
    return f"NO ({_f(rec.get('identical_fraction'), '.0%')})"


def _ok(rec: dict | None) -> bool:
    return rec is not None and rec["status"] == "ok"


# ------------------------------------------------------------- one run
def _commit(doc_git: dict | None) -> str:
    if not doc_git or not doc_git.get("commit"):
        return "not recorded"
    return doc_git["commit"][:10] + (" (with uncommitted changes)" if doc_git.get("dirty") else "")


def _machine(info) -> str:
    if not info:
        return "not recorded"
    if not isinstance(info, dict):
        return f"CPU model and flags not recorded ({info})"
    flags = " ".join(info.get("isa") or []) or "not recorded"
    return (f"{info.get('model_name') or info.get('processor') or 'CPU model not recorded'}, "
            f"{info.get('cpus_available')} of {info.get('cpu_count')} CPUs, "
            f"{info.get('memory_gib', '?')} GiB; vector flags: {flags}")


def display_command(command: str, name: str) -> str:
    """The run's command as a reader would re-run it: ``--out`` this file,
    without the harness-local ``--log-dir``, one option per line."""
    command = re.sub(r" --log-dir \S+", "", command)
    # a command recorded by a plain join lost an empty value's quotes
    command = re.sub(r"(--[\w-]+)  (?=--|$)", r"\1 '' ", command)
    parts = command.split(" ; ")
    if len(parts) == 1:
        return _wrap(re.sub(r"--out \S+", f"--out benchmarks/results/{name}", command))
    return "\n".join(_wrap(re.sub(r"--out \S+", f"--out part{i}.json", one))
                     for i, one in enumerate(parts, 1))


def _wrap(command: str, width: int = 96) -> str:
    lines, line = [], ""
    for i, piece in enumerate(command.split(" --")):
        piece = piece if i == 0 else "--" + piece
        if line and len(line) + len(piece) + 1 > width:
            lines.append(line)
            line = "    " + piece
        else:
            line = f"{line} {piece}" if line else piece
    return " \\\n".join(lines + [line])


def file_link(name: str) -> str:
    """A result file's link, with its plot's when there is one."""
    png = Path(name).with_suffix(".png").name
    plot = f" (plot: [`{png}`](results/{png}))" if (C.RESULTS_DIR / png).is_file() else ""
    return f"[`{name}`](results/{name}){plot}"


def run_header(doc: dict, name: str) -> list[str]:
    run = doc["run"]
    ver = run.get("versions") or {}
    minutes = (run.get("total_seconds") or 0) / 60
    parts = (" (run in parts, one command per part, joined after checking that every part's "
             "plain decoding gave the same outputs)" if " ; " in run["command"] else "")
    return [
        f"- File: {file_link(name)}; measured {run['started_at'][:10]}, "
        f"{minutes:.0f} min{parts}",
        f"- Machine: {_machine(run.get('machine'))}",
        f"- Commit: {_commit(run.get('git'))}; vLLM {ver.get('vllm')}, torch {ver.get('torch')}",
        f"- Settings: {run['dtype']}, {run_mode(doc)}, greedy, {run['limit']} prompts x "
        f"{run['max_tokens']} tokens per suite, k={run['num_speculative_tokens']} unless a "
        f"method's options set its own, repeats {run.get('repeats', 1)}, {_pairing(run)}"
        + (", EOS ignored" if run.get("ignore_eos") else ""),
        "",
        "```bash",
        display_command(run["command"], name),
        "```",
        "",
    ]


def _pairing(run: dict) -> str:
    if not run.get("paired"):
        return "unpaired"
    group = run.get("pair_group") or 1
    return ("paired, one plain-decoding engine per method" if group == 1
            else f"paired, up to {group} methods per plain-decoding engine")


def run_table(doc: dict, batch: int) -> list[str]:
    lines = ["| method | suite | tau | speculation speedup | min–max | speedup | min–max "
             "| kernel | drafted | identical | estimator |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    recs = [r for r in doc["records"] if r["batch_size"] == batch]
    methods = [m for m in dict.fromkeys(r["method"] for r in recs) if m != "none"]
    for m in methods:
        for r in (x for x in recs if x["method"] == m):
            if not _ok(r):
                lines.append(f"| {m} | {r['suite']} | {r['status']} | | | | | | | | "
                             f"{(r.get('reason') or '')[:80]} |")
                continue
            speed, spread, how = speedup_estimate(r)
            spec, spec_spread, kernel = speculation_cells(r)
            rate = record_draft_rate(r)
            lines.append(f"| {m} | {r['suite']} | {_f(record_tau(r))} | {spec} | {spec_spread} "
                         f"| {_f(speed)}x | {spread} | {kernel} | {_f(rate, '.0%')} | "
                         f"{_identical(r)} | {how} |")
    return lines + [""]


def run_section(run: C.Run, level: str = "##") -> list[str]:
    doc = C.load(run.file)
    out = [f"{level} {run.title}", "", run.about, ""] + run_header(doc, run.file)
    for b in doc["run"]["batch_sizes"]:
        out += [f"Batch {b}:", ""] + run_table(doc, b)
    for name, about in reruns(run, doc):
        sub = C.load(name)
        out += [f"Re-run: {about}", ""] + run_header(sub, name)
        for b in sub["run"]["batch_sizes"]:
            out += run_table(sub, b)
    return out


# ------------------------------------------------------------- other results
def verify_cost_section() -> list[str]:
    out = ["## Cost of one verification step", "",
           "`python -m benchmarks.verify_cost`: a step verifying a random tree of S nodes "
           "(that accepts nothing) against a plain step, in milliseconds; the ratio is the "
           "tree's cost in plain steps.", ""]
    for name, title in C.VERIFY_COST:
        doc = C.load(name)
        meta = doc["meta"]
        out += [f"### {title}", "",
                f"- File: {file_link(name)}; {meta.get('dtype')}, "
                + ("eager" if meta.get("enforce_eager", True) else "compiled")
                + f", {meta.get('steps')} steps per timing"
                + (f", {meta['repeats']} paired repeats" if meta.get("repeats") else ""),
                f"- Machine: {_machine(meta.get('machine'))}",
                f"- Commit: {_commit(meta.get('git'))}"]
        kernel = _kernel_state(meta)
        out += ([f"- The plugin's CPU linear kernel in its engines: {kernel}"] if kernel else []) + [""]
        out += (_cost_pairs(doc) if meta.get("repeats") else _cost_grid(doc)) + [""]
    return out


def _cost_grid(doc: dict) -> list[str]:
    recs = doc["records"]
    sizes = sorted({r["tree_size"] for r in recs})
    out = ["| batch | " + " | ".join("plain" if s == 0 else f"tree {s}" for s in sizes) + " |",
           "|---" * (len(sizes) + 1) + "|"]
    for b in sorted({r["batch_size"] for r in recs}):
        row = {r["tree_size"]: r for r in recs if r["batch_size"] == b}
        out.append(f"| {b} | " + " | ".join(
            f"{row[s]['step_ms']:.0f} ms" + ("" if s == 0 else f" ({row[s]['relative_to_plain']:.1f}x)")
            if s in row else "" for s in sizes) + " |")
    return out


def _cost_pairs(doc: dict) -> list[str]:
    batches = len({r["batch_size"] for r in doc["records"]}) > 1
    lead = "| batch " if batches else ""
    out = [lead + "| tree nodes | step (median) | x vLLM plain step (min–max) | "
           "x the plugin's plain step (min–max) |", "|---" * (4 + batches) + "|"]
    for r in doc["records"]:
        head = f"| {r['batch_size']} " if batches else ""
        if r["tree_size"] == 0:
            out.append(head + f"| 0 (vLLM plain) | {r['step_ms']:.1f} ms | 1.00 | "
                       f"plugin plain {_f(r.get('plugin_plain_step_ms'), '.1f')} ms |")
            continue
        cells = []
        for key in ("relative_to_plain", "relative_to_plugin_plain"):
            reps = r.get(f"{key}_repeats") or []
            cells.append(f"{_f(r.get(key))}" + (f" ({min(reps):.2f}–{max(reps):.2f})" if reps else ""))
        out.append(head + f"| {r['tree_size']} | {r['step_ms']:.1f} ms | {cells[0]} | {cells[1]} |")
    return out


def _kernel_state(meta: dict) -> str | None:
    """The plugin's CPU linear kernel in a cost run's plugin engines, where
    the run recorded it (runs before it was recorded: None)."""
    state = meta.get("cpu_linear")
    if state is None:
        return None
    return ("on" if state.get("enabled") else "off") + f" (`SPECPLUG_CPU_LINEAR` {state.get('env') or 'unset'})"


def soak_section() -> list[str]:
    out = ["## Soak runs", "",
           "`python -m benchmarks.soak`: an OpenAI-compatible server under concurrent mixed "
           "requests (with aborts) for the stated duration; every check must pass.", "",
           "| method | file | seconds | requests (aborted) | greedy answers compared "
           "(mismatches) | RSS growth after warm-up | passed | machine | commit |",
           "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(C.RESULTS_DIR.glob(C.SOAK_GLOB)):
        d = C.load(path.name)
        srv = d.get("spec_server") or {}
        out.append(f"| {d['method']} | [`{path.name}`](results/{path.name}) | "
                   f"{d['duration_s']:.0f} | {srv.get('requests')} ({srv.get('aborted')}) | "
                   f"{d.get('greedy_compared')} ({d.get('greedy_mismatches')}) | "
                   f"{_f(srv.get('rss_growth_after_warmup'), '.1%')} | "
                   f"{'yes' if d['passed'] else 'NO'} | {_machine(d.get('machine'))} | "
                   f"{_commit(d.get('git'))} |")
    return out + [""]


def isolation_table() -> list[str]:
    d = C.load(C.ISOLATION)
    w = d["workload"]
    out = [f"{w['prompts']} prompts from {', '.join(w['suites'])}, each asked in turn by "
           f"{w['tenants']} tenants (one `cache_salt` each), one request at a time, "
           f"{w['max_tokens']} tokens, greedy, {w['dtype']}; {_machine(d.get('machine'))}; "
           f"commit {_commit(d.get('git'))}. `{d['command'].strip()}`", "",
           "| method | isolation | tau | tau, first asker | tau, later askers | identical |",
           "|---|---|---|---|---|---|"]
    for r in d["results"]:
        out.append(f"| {r['method']} | `{r['isolation']}` | {_f(r['tau'])} | "
                   f"{_f(r['tau_first_asker'])} | {_f(r['tau_later_askers'])} | "
                   f"{'yes' if r['identical'] else 'NO'} |")
    return out


def isolation_section() -> list[str]:
    return ["## Tenant isolation and acceptance", "",
            "`python -m benchmarks.studies.isolation_tau`: what each `isolation` mode costs "
            "in tokens per target pass when tenants ask the same questions.", "",
            *isolation_table(), ""]


# ------------------------------------------------------------- serving
def _sweep_minutes(run: dict) -> str:
    from datetime import datetime

    if not run.get("finished"):
        return "unfinished"
    start, end = (datetime.strptime(run[k], "%Y-%m-%dT%H:%M:%SZ")
                  for k in ("started", "finished"))
    return f"{(end - start).total_seconds() / 60:.0f} min"


def serving_plots(doc: dict, name: str) -> list[str]:
    """The sweep's plots (``serve_report.plot_all`` writes them beside it),
    named from its own groups: another sweep's file whose name starts with
    this one's is not one of them."""
    from benchmarks.serve_report import plot_path

    names = {Path(plot_path(Path(name).stem, r["dataset"], r["temperature"])).name
             for r in doc.get("records", [])}
    return sorted(n for n in names if (C.RESULTS_DIR / n).is_file())


def serving_header(doc: dict, name: str) -> list[str]:
    run, cfg = doc["run"], doc["run"]["config"]
    plots = ", ".join(f"[`{p}`](results/{p})" for p in serving_plots(doc, name)) or "none"
    skipped = "; ".join(f"`{s['method']}` skipped: {s['reason']}" for s in doc.get("skipped", []))
    failed = "; ".join(f"`{f['method']}` FAILED: {f['error'][-200:]}"
                       for f in doc.get("failed", []))
    return [
        f"- File: [`{name}`](results/{name}); plots: {plots}; measured {run['started'][:10]}, "
        f"{_sweep_minutes(run)}",
        f"- Machine: {_machine(run.get('machine'))}",
        f"- Commit: {_commit(run.get('git'))}; vLLM {run.get('vllm')}",
        f"- Settings: {run['dtype']}, {'compiled' if run.get('compiled') else 'eager'}, "
        f"`--max-num-seqs {cfg['max_num_seqs']}`, answers up to {cfg['output_len']} tokens, "
        f"{cfg['prompts_per_stream']} prompts per stream (at least {cfg['min_prompts']}), "
        f"Poisson points {cfg['rate_seconds']} s of arrivals; "
        + (f"{cfg['repeats']} passes per point, each method on a fresh server in each "
           "(median, tokens/s min-max in brackets)" if cfg.get("repeats", 1) > 1
           else "each point measured once")
        + (f"; {skipped}" if skipped else "") + (f"; {failed}" if failed else ""),
        "", "```bash", display_command(_with_passes(run["command"], cfg), name), "```", ""]


def _with_passes(command: str, cfg: dict) -> str:
    """A sweep's command with its passes spelled out: one run before the
    configuration's default became several passes re-runs as it ran."""
    if "--repeats" in command:
        return command
    return command + f" --repeats {cfg.get('repeats', 1)}"


def serving_section(run: C.Run) -> list[str]:
    from benchmarks import serve_report as SR

    doc = C.load(run.file)
    kinds = SR.method_kinds(doc)
    misses = SR.targets(doc)
    out = [f"## {run.title}", "", run.about, ""] + serving_header(doc, run.file)
    out += ["Against plain decoding (`none`):", "", SR.render_markdown(doc, "none")]
    if "plain" in kinds:
        out += ["Speculation apart from the CPU linear kernel (against `plain`, the plugin's "
                "engine drafting nothing):", "", SR.render_markdown(doc, "plain")]
    out += ["Targets (every specplug method at least 0.97x `none`'s output tokens/s and at "
            "most 1.03x its p99 TPOT at every point; the best at least 1.3x `none` at one "
            "stream and ahead of `suffix` and `ngram` at every concurrency): "
            + ("all met." if not misses else f"{len(misses)} missed:"), ""]
    return out + [f"- {m}" for m in misses] + [""]


def _serving_cell(rec: dict | None, none: dict | None, plain: dict | None) -> str:
    from benchmarks.serve_report import ratio

    if rec is None:
        return "–"
    vs_none = ratio(rec, none, "output_throughput")
    vs_plain = ratio(rec, plain, "output_throughput") if plain else None
    text = "–" if vs_none is None else f"{vs_none:.2f}x"
    return text + (f" ({vs_plain:.2f}x)" if vs_plain is not None and rec is not plain else "")


def _short_title(title: str) -> str:
    """A sweep's title without its section's common start."""
    return title.split(": ", 1)[-1]


def serving_block(link: str) -> str:
    """Per canonical sweep, dataset and temperature: each method's output
    tokens/s over plain decoding's at every load point, over the plugin's
    engine drafting nothing in parentheses."""
    from benchmarks import serve_report as SR

    if not C.SERVING:
        return f"No serving sweep yet; see [RESULTS.md]({link})."
    lines = []
    seen: set[tuple] = set()
    for run in C.SERVING:
        doc = C.load(run.file)
        kinds = SR.method_kinds(doc)
        for (dataset, temp), recs in SR.groups(doc).items():
            cols = list(dict.fromkeys((r["load"], r["value"]) for r in recs))
            at = {(r["method"], r["load"], r["value"]): r for r in recs}
            # a later sweep of the same dataset and temperature (other
            # methods, another day) is its own table: never mix two runs
            again = f" ({_short_title(run.title)})" if (dataset, temp) in seen else ""
            seen.add((dataset, temp))
            lines += [f"**{dataset}, temperature {temp:g}**{again}", "",
                      "| method | " + " | ".join(SR.load_label(*c) for c in cols) + " |",
                      "|---|" + "---|" * len(cols)]
            for m in dict.fromkeys(r["method"] for r in recs):
                if m == SR.BASELINE:
                    continue
                cells = [_serving_cell(at.get((m, *c)), at.get((SR.BASELINE, *c)),
                                       at.get(("plain", *c)) if kinds[m] == "specplug"
                                       else None) for c in cols]
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["Output tokens/s over plain decoding's (`none`) at the same load point; for "
              "specplug methods, over `plain` (the plugin's engine drafting nothing: "
              "speculation apart from the CPU linear kernel) in parentheses. c: concurrent "
              "streams; req/s: Poisson arrivals, where throughput follows the arrivals while "
              "the server keeps up and latency (p99 TPOT) tells methods apart. "
              "Latency, tau, machine and commands: "
              f"[RESULTS.md]({link})."]
    return "\n".join(lines)


def _checks_line(checks: list[dict], kernel: str) -> str:
    rows = [c for c in checks if c["kernel"] == kernel]
    worst = {}
    for c in rows:
        if "max_abs_err" in c:
            worst[c["dtype"]] = max(worst.get(c["dtype"], 0.0), c["max_abs_err"])
    errs = ", ".join(f"{d} {e:.1e}" for d, e in sorted(worst.items()))
    return (f"| `{kernel}` | {sum(c['ok'] for c in rows)} / {len(rows)} | "
            + (errs or "exact") + " |")


def gpu_kernel_section() -> list[str]:
    d = C.load(C.GPU_KERNEL_CHECK)
    env, checks = d["environment"], d["checks"]
    out = ["## GPU kernel check", "",
           "`python -m vllm_specplug.kernels.check --jobs 14` (torch, Triton and numpy only; "
           "vLLM not installed): every Triton kernel against its torch reference over the "
           "full grid, the start-up warm-up's cover, the EAGLE-3 head's tree expansion on "
           "CUDA against CPU, and timings (CUDA events, median of 20).", "",
           f"- File: {file_link(C.GPU_KERNEL_CHECK)}; {env['device']}, torch {env['torch']} "
           f"(CUDA {env['cuda']}), Triton {env.get('triton')}; {d['seconds']:.0f} s; "
           f"{d['failed']} misses.", "",
           "| kernel | checks passed | largest error (per dtype) |", "|---|---|---|"]
    kernels = dict.fromkeys(c["kernel"] for c in checks)
    out += [_checks_line(checks, k) for k in kernels]
    for c in d.get("eagle3", {}).get("checks", []):
        out.append(f"| EAGLE-3 tree expansion, {c['shape']} | {int(c['ok'])} / 1 | "
                   f"same trees, CUDA against CPU |")
    w = d.get("warm_up", {})
    if "new_variants_while_serving" in w:
        out += ["", f"Warm-up: after `warm_up_gpu_kernels`, 40 serving-shaped tree steps and KV "
                f"moves compiled {sum((w['new_variants_while_serving'] or {}).values())} new "
                f"Triton variants (slowest step {w['slowest_step_ms']:.2f} ms)."]
    timing = d.get("timing", {})
    out += ["", "| timed (bfloat16) | ms | reference | ms |", "|---|---|---|---|"]
    for case in timing.get("tree_attention", {}).get("cases", []):
        s = case["shape"]
        what = (f"tree attention, {s['requests']} x {s['nodes']} nodes, context "
                f"{s['context']}, {s['q_heads']}/{s['kv_heads']} heads x {s['head_dim']}")
        out.append(f"| {what} | {case['tree_attention_ms']:.3f} (split KV "
                   f"{case['tree_attention_split_ms']:.3f}) | torch SDPA, masked, on K/V "
                   f"gathered beforehand | {case['sdpa_masked_ms']:.3f} |")
    kv = timing.get("kv_move")
    if kv:
        s = kv["shape"]
        out.append(f"| KV move, {s['layers']} layers x {s['moves']} slots, all layers in one "
                   f"launch pair | {kv['kv_move_caches_ms']:.3f} | torch gather/scatter per "
                   f"stacked cache | {kv['torch_gather_scatter_ms']:.3f} |")
    return out + [""] + gpu_tiles_table()


def gpu_tiles_table() -> list[str]:
    """Tree attention's launch (split KV as the runner picks it) per tile
    size: the former 16-row tile, the one the kernel picks now, the fastest."""
    d = C.load(C.GPU_TREE_TILES)
    out = [f"Tile sizes (`python -m benchmarks.studies.gpu_tree_tiles`, "
           f"{file_link(C.GPU_TREE_TILES)}; {d['device']}; bfloat16, ms, split KV as the "
           "runner picks it; rows: (token, head) pairs per program):", "",
           "| requests x nodes, context, head size, q/kv heads | torch SDPA | 16 rows x 32 keys "
           "(former) | 64 rows x 64 keys (now) | fastest |", "|---|---|---|---|---|"]
    for shape, (reqs, nodes, ctx, head_dim, qpk, kvh) in d["shapes"].items():
        rows = [r for r in d["rows"] if r["shape"] == shape and "split_ms" in r]

        def pick(tile_rows, keys):
            hit = [r for r in rows if r["tile_rows"] == tile_rows and r["block_n"] == keys
                   and r["num_warps"] == 4]
            return _f(hit[0]["split_ms"], ".3f") if hit else "–"

        best = min(rows, key=lambda r: r["split_ms"])
        out.append(f"| {reqs} x {nodes}, {ctx}, {head_dim}, {qpk * kvh}/{kvh} | "
                   f"{rows[0]['sdpa_ms']:.3f} | {pick(max(16, qpk), 32)} | {pick(64, 64)} | "
                   f"{best['split_ms']:.3f} ({best['tile_rows']} rows x {best['block_n']} keys, "
                   f"{best['num_warps']} warps) |")
    return out + [""]


# ------------------------------------------------------------- RESULTS.md
def results_md() -> str:
    out = ["# Benchmark results", "",
           f"Generated by `{COMMAND}` from the canonical files in `benchmarks/results/` "
           "(listed in `benchmarks/canonical.py`). Do not edit by hand: re-run the command "
           f"(`{COMMAND} --check` fails when this file is stale). How the figures are "
           "measured: [docs/benchmarks.md](../docs/benchmarks.md).", "",
           "How to read the tables:", "",
           "- **tau**: tokens per target pass, generated / (generated − accepted), pooled "
           "over a suite. It depends only on what a method drafts, not on the machine.",
           "- **speculation speedup**: tokens/s over `plain`, the plugin's engine drafting "
           "nothing, in the same run (vLLM's own methods run stock: over `none`): what "
           "speculation earns. — where a file predates the figure.",
           f"- **speedup**: tokens/s over plain decoding's. {SPEEDUP_NOTE}",
           "- **kernel**: `plain` over `none`, what the plugin's CPU linear kernel earns "
           "without speculation (specplug rows).",
           "- **min–max** and **estimator**: each figure is the median over the cell's timed "
           "passes (paired: of the ratios of calls timed in turn with a plain-decoding "
           "engine), min–max beside it; a method that remembers earlier outputs gets a fresh "
           "engine per pass (older files timed it once per suite).",
           "- **drafted**: drafts per target pass, the share of steps in which the method "
           "proposed anything.",
           "- **identical**: every output token-identical to plain decoding's.",
           "- Plain decoding (`none`) is the reference of every table: tau 1.00, speedup 1.00x.",
           ""]
    out += ["## Contents", ""] + ["- Against vLLM's built-ins"] + [
        f"- {r.title}" for r in (*headline_runs(), *C.HELD_OUT, *C.METHOD_RUNS, *C.SERVING)] + [
        "- Cost of one verification step", "- Soak runs", "- Tenant isolation and acceptance",
        "- GPU kernel check", "- Study outputs", ""]
    out += ["## Against vLLM's built-ins", "",
            versus_block(None), ""]
    for parts in C.ALL_METHODS.values():
        for run in parts:
            out += run_section(run)
    for run in (*C.HELD_OUT, *C.METHOD_RUNS):
        out += run_section(run)
    for run in C.SERVING:
        out += serving_section(run)
    out += (verify_cost_section() + soak_section() + isolation_section()
            + gpu_kernel_section())
    out += ["## Study outputs", ""] + [
        f"- {file_link(name)} (`python -m {cmd}`): {what}"
        for name, cmd, what in C.STUDY_OUTPUTS] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


# ------------------------------------------------------------- blocks
def headline_runs() -> list[C.Run]:
    return [run for parts in C.ALL_METHODS.values() for run in parts]


def reruns(run: C.Run, doc: dict) -> tuple[tuple[str, str], ...]:
    """``run``'s re-runs of single cells: only files of the first format
    have them; a later run is reported whole, never patched cell by cell."""
    if run.reruns and doc.get("schema_version", 1) >= 2:
        raise ValueError(f"{run.file}: re-runs of single cells are not part of the "
                         "protocol (docs/benchmarks.md); re-run the whole run instead")
    return run.reruns


def best_cells(batch: int, runs: tuple[C.Run, ...] | None = None
               ) -> dict[tuple[str, str], tuple[dict, bool]]:
    """(method, suite) -> (record, re-measured) of the all-methods runs at
    ``batch`` (one run, or whole runs over disjoint suites; ``runs``: other
    runs than the headline ones); a first-format re-run's record replaces
    the run's for the cells it has."""
    cells: dict[tuple[str, str], tuple[dict, bool]] = {}
    for run in C.ALL_METHODS[batch] if runs is None else runs:
        doc = C.load(run.file)
        mine = {(r["method"], r["suite"]): (r, False)
                for r in doc["records"] if r["batch_size"] == batch}
        shared = {s for _, s in mine} & {s for _, s in cells}
        if shared:
            raise ValueError(f"{run.file}: suites {sorted(shared)} are in another part of "
                             f"the batch-{batch} runs; parts must measure disjoint suites")
        for name, _ in reruns(run, doc):
            for r in C.load(name)["records"]:
                if r["method"] != "none" and r["batch_size"] == batch and _ok(r):
                    mine[(r["method"], r["suite"])] = (r, True)
        cells.update(mine)
    return cells


def _range(values: list[float], spec: str = ".2f", unit: str = "") -> str:
    if not values:
        return "–"
    lo, hi = format(min(values), spec), format(max(values), spec)
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def has_speculation(cells: dict) -> bool:
    """Whether the headline runs have speculation speedups (``plain`` ran)."""
    return any(r.get("speculation_speedup") is not None
               for by_cell in cells.values() for r, _ in by_cell.values())


def _block_head(first: str, batches: list[int], spec: bool) -> list[str]:
    names = [f"tau, batch {b}" + (f" | speculation speedup, batch {b}" if spec else "")
             + f" | speedup, batch {b}" for b in batches]
    return [f"| {first} | " + " | ".join(names) + " |",
            "|---" * (1 + (3 if spec else 2) * len(batches)) + "|"]


def summary_block(link: str) -> str:
    batches = sorted(C.ALL_METHODS)
    cells = {b: best_cells(b) for b in batches}
    methods = list(dict.fromkeys(m for b in batches for m, _ in cells[b] if m != "none"))
    n_suites = {b: len({s for _, s in cells[b]}) for b in batches}
    spec = has_speculation(cells)
    lines = _block_head("method", batches, spec)
    for m in methods:
        row, builtin = [], False
        for b in batches:
            recs = [r for (mm, _), (r, _) in cells[b].items() if mm == m and _ok(r)]
            builtin |= any(r["method_kind"] == "vllm" for r in recs)
            row.append(_range([record_tau(r) for r in recs if record_tau(r) is not None]))
            if spec:
                row.append(_range([r["speculation_speedup"] for r in recs
                                   if r.get("speculation_speedup") is not None], unit="x"))
            row.append(_range([r["speedup"] for r in recs if r["speedup"] is not None],
                              unit="x"))
        name = f"{m} (vLLM built-in)" if builtin else m
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    machine = _machine(C.load(C.ALL_METHODS[batches[0]][0].file)["run"].get("machine"))
    how = ("each cell the median of its passes" if spec
           else "a cell re-measured with repeats counts with its re-run")
    if len(set(n_suites.values())) == 1:
        over = f"over {n_suites[batches[0]]} suites ("
    else:  # a batch size measured on some suites so far
        over = "over the suites of each batch size (" + ", ".join(
            f"batch {b}: {n}" for b, n in n_suites.items()) + "; "
    lines += ["", f"Lowest–highest {over}Spec-Bench's categories and "
              f"HumanEval; {how}), {machine}; tau is tokens per target pass. "
              f"{SPECULATION_NOTE if spec else SPEEDUP_NOTE} "
              f"Every figure, with how it was measured: [RESULTS.md]({link})."]
    return "\n".join(lines)


def method_block(method: str, link: str) -> str:
    batches = sorted(C.ALL_METHODS)
    cells = {b: best_cells(b) for b in batches}
    suites = list(dict.fromkeys(s for b in batches for _, s in cells[b]))
    if not any((method, s) in cells[b] for b in batches for s in suites):
        return f"`{method}` is not in the all-methods runs; see [RESULTS.md]({link})."
    spec = has_speculation(cells)
    lines = _block_head("suite", batches, spec)
    marked = False
    for s in suites:
        row = []
        for b in batches:
            rec, again = cells[b].get((method, s), (None, False))
            if not _ok(rec):
                row += ["–"] * (3 if spec else 2)
                continue
            marked |= again
            row.append(_f(record_tau(rec)))
            if spec:
                row.append(speculation_cells(rec)[0])
            row.append(_f(rec["speedup"]) + "x" + (" *" if again else ""))
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    lines += ["", (f"* re-measured with more repeats. " if marked else "")
              + (SPECULATION_NOTE if spec else SPEEDUP_NOTE)
              + f" Runs, machine and commands: [RESULTS.md]({link})."]
    return "\n".join(lines)


AUTO_LEAVES_OUT = {"auto", "plain", "oracle"}
"""Not single methods ``auto`` is held against (itself, the plugin's engine
drafting nothing, the test method)."""


def _speculation(rec: dict) -> float | None:
    return rec.get("speculation_speedup")


def _best_single(cells: dict, suite: str, figure, kind: str = "specplug",
                 leave_out: set[str] = AUTO_LEAVES_OUT) -> tuple[str, float] | None:
    """The method of ``kind`` (``specplug`` or ``vllm``), none of
    ``leave_out``, with the highest ``figure(record)`` on ``suite`` (name,
    value)."""
    scored = [(figure(r), m) for (m, s), (r, _) in cells.items()
              if s == suite and m.split("@")[0] not in leave_out and _ok(r)
              and r["method_kind"] == kind and figure(r) is not None]
    if not scored:
        return None
    value, name = max(scored)
    return name, value


def _suite_groups() -> list[tuple[int, str, dict]]:
    """(batch, note after the suite's name, best cells) for each headline
    batch size, then the held-out runs (batch 1)."""
    groups = [(b, "", best_cells(b)) for b in sorted(C.ALL_METHODS)]
    if C.HELD_OUT:
        groups.append((1, " (held out)", best_cells(1, C.HELD_OUT)))
    return groups


def auto_block(link: str) -> str:
    """``auto`` against the best single specplug method of each suite and
    batch size, held-out work included, on tau and on speculation speedup
    (its targets: 0.97x)."""
    groups = _suite_groups()
    if not any(m == "auto" for _, _, cells in groups for m, _ in cells):
        return f"`auto` is not in the all-methods runs yet; see [RESULTS.md]({link})."
    lines = ["| batch | suite | tau | best single (tau) | ratio | speculation speedup "
             "| best single (speculation speedup) | ratio |", "|---" * 8 + "|"]
    for b, note, cells in groups:
        for s in dict.fromkeys(s for _, s in cells):
            rec = cells.get(("auto", s), (None, False))[0]
            row = [str(b), s + note]
            if not _ok(rec):
                lines.append("| " + " | ".join(row + ["–"] * 6) + " |")
                continue
            for figure in (record_tau, _speculation):
                mine, best = figure(rec), _best_single(cells, s, figure)
                row.append(_f(mine))
                row.append("–" if best is None else f"{best[0]} ({best[1]:.2f})")
                row.append("–" if best is None or mine is None else f"{mine / best[1]:.2f}")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Ratio: `auto`'s figure over the best single specplug method's on the "
              "same suite and batch size, each method's best taken apart (tau and speed can "
              "have different leaders). " + SPECULATION_NOTE
              + f" Runs, machine and commands: [RESULTS.md]({link})."]
    return "\n".join(lines)


def versus_block(link: str | None) -> str:
    """Per suite and batch size, the best specplug method against the best
    of vLLM's built-ins on speculation speedup (each against its own
    engine drafting nothing), the headline runs and the held-out ones."""
    groups = _suite_groups()
    lines = ["| batch | suite | best specplug: speculation speedup (tau) | best built-in: "
             "speculation speedup (tau) | ratio |", "|---" * 5 + "|"]
    for batch, note, cells in groups:
        for suite in dict.fromkeys(s for _, s in cells):
            # the plugin's engine drafting nothing and the test method do not contend
            mine, theirs = (_best_single(cells, suite, _speculation, kind, {"plain", "oracle"})
                            for kind in ("specplug", "vllm"))
            row = [str(batch), suite + note]
            for lead in (mine, theirs):
                row.append("–" if lead is None else f"{lead[0]} {lead[1]:.2f}x "
                           f"({_f(record_tau(cells[(lead[0], suite)][0]))})")
            row.append("–" if mine is None or theirs is None else f"{mine[1] / theirs[1]:.2f}")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Ratio: the best specplug method's speculation speedup over the best "
              "built-in's on the same suite and batch size; medians of each cell's passes. "
              + SPECULATION_NOTE
              + (f" Runs, machine and commands: [RESULTS.md]({link})." if link else "")]
    return "\n".join(lines)


def fill_blocks(text: str, path: Path) -> str:
    """``text`` of the file at ``path`` with every generated block re-rendered."""
    link = _rel(C.RESULTS_MD, path)

    def render(m: re.Match) -> str:
        kind = m.group(2)
        if kind == "summary":
            body = summary_block(link)
        elif kind == "auto":
            body = auto_block(link)
        elif kind == "versus":
            body = versus_block(link)
        elif kind == "serving":
            body = serving_block(link)
        elif kind == "isolation":
            body = "\n".join(isolation_table() + ["", f"Runs, machine and commands: [RESULTS.md]({link})."])
        else:
            body = method_block(m.group(3), link)
        return f"{m.group(1)}\n{body}\n\n{m.group(5)}"

    return BLOCK.sub(render, text)


def documents() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    found = [C.REPO_ROOT / "README.md"] + sorted((C.REPO_ROOT / "docs").rglob("*.md"))
    return [p for p in found if p.is_file()]


def _read(path: Path) -> str:
    # bytes, not text mode: a file's line endings must survive untouched
    return path.read_bytes().decode("utf-8")


def expected() -> dict[Path, str]:
    """Every generated file and document with blocks, as it should read now."""
    out = {C.RESULTS_MD: results_md()}
    for path in documents():
        text = _read(path)
        if BLOCK.search(text):
            out[path] = fill_blocks(text, path)
    return out


def stale() -> list[Path]:
    return [p for p, text in expected().items()
            if not p.is_file() or _read(p) != text]


def write() -> list[Path]:
    changed = stale()
    for path, text in expected().items():
        if path in changed:
            path.write_bytes(text.encode("utf-8"))
    return changed
