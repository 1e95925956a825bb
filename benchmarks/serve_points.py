"""The serving sweep's plan and figures, without a server (unit-tested).

- :class:`Point`: one load point (a max concurrency, or a Poisson request
  rate) at one temperature on one dataset, with the prompts it sends;
- :func:`plan_points`: every point of a dataset, each with its own slice of
  the dataset's prompts (methods that remember earlier outputs must not be
  measured on answers they already gave);
- :func:`write_sharegpt_file`: a point's prompts in the ShareGPT format that
  ``vllm bench serve --dataset-name sharegpt`` reads (one user turn each;
  the server applies the chat template);
- :func:`bench_command`: the ``vllm bench serve`` command of a point;
- :func:`spec_deltas`: speculative figures from two ``/metrics`` scrapes;
- :func:`point_record`: one record of the result JSON from vLLM's bench
  result and those deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

PERCENTILES = (50, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Point:
    dataset: str
    temperature: float
    kind: str
    """``concurrency`` (closed loop: that many requests in flight) or
    ``rate`` (open loop: Poisson arrivals at ``value`` requests/s)."""
    value: float
    prompts: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        load = f"c{int(self.value)}" if self.kind == "concurrency" else f"r{self.value:g}"
        return f"{self.dataset}-t{self.temperature:g}-{load}"


def prompts_for(kind: str, value: float, cfg: dict) -> int:
    """How many prompts a point sends: a concurrency point
    ``prompts_per_stream`` per stream (at least ``min_prompts``), a rate
    point enough for ``rate_seconds`` of arrivals (at least ``min_prompts``)."""
    if kind == "concurrency":
        n = cfg["prompts_per_stream"] * int(value)
    else:
        n = round(value * cfg["rate_seconds"])
    return max(cfg["min_prompts"], n)


def plan_points(dataset: str, texts: list[str], cfg: dict) -> list[Point]:
    """Every point of ``dataset`` for each temperature: the concurrencies,
    then the rates. Each point takes the next prompts of ``texts`` (after
    ``warmup_prompts``), wrapping round only when the dataset runs out."""
    if not texts:
        raise ValueError(f"dataset {dataset}: no prompt")
    loads = [("concurrency", float(c)) for c in cfg["concurrency"]]
    loads += [("rate", float(r)) for r in cfg["request_rates"]]
    cursor = cfg.get("warmup_prompts", 0) % len(texts)
    points = []
    for temperature in cfg["temperatures"]:
        for kind, value in loads:
            n = prompts_for(kind, value, cfg)
            take = [texts[(cursor + i) % len(texts)] for i in range(n)]
            cursor = (cursor + n) % len(texts)
            points.append(Point(dataset, float(temperature), kind, value, take))
    return points


def warmup_texts(texts: list[str], cfg: dict) -> list[str]:
    """The prompts a fresh server answers before its first measured point."""
    return texts[:cfg.get("warmup_prompts", 0)]


def write_sharegpt_file(path: str, prompts: list[str]) -> None:
    """``prompts`` as ShareGPT conversations (vLLM's reader needs a second
    turn; its text is unused once ``--sharegpt-output-len`` is given)."""
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": p},
                                             {"from": "gpt", "value": ""}]}
            for i, p in enumerate(prompts)]
    with open(path, "w") as f:
        json.dump(rows, f)


def bench_command(vllm: list[str], base_url: str, model: str, point: Point,
                  dataset_file: str, output_len: int, result_dir: str,
                  result_file: str, seed: int = 0) -> list[str]:
    """``vllm bench serve`` for one point: chat completions (streamed, so
    TTFT and ITL are measured), the point's prompts in order, exactly as
    many as the point holds."""
    cmd = [*vllm, "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
           "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", model,
           "--dataset-name", "sharegpt", "--dataset-path", dataset_file,
           "--sharegpt-output-len", str(output_len), "--num-prompts", str(len(point.prompts)),
           "--disable-shuffle", "--no-oversample", "--seed", str(seed),
           "--temperature", f"{point.temperature:g}",
           "--percentile-metrics", ",".join(LATENCIES),
           "--metric-percentiles", ",".join(map(str, PERCENTILES)),
           "--save-result", "--result-dir", result_dir, "--result-filename", result_file,
           "--disable-tqdm"]
    if point.kind == "concurrency":
        cmd += ["--max-concurrency", str(int(point.value)), "--request-rate", "inf"]
    else:
        cmd += ["--request-rate", f"{point.value:g}", "--burstiness", "1.0"]
    return cmd


# ------------------------------------------------------------------ figures
SPEC_SERIES = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "generation_tokens": "vllm:generation_tokens",
}


def _total(metrics: dict[str, float], series: str) -> float:
    """A counter's value in a :func:`benchmarks.soak.parse_metrics` dict
    (``_total`` suffixed or not, summed over labels)."""
    return metrics.get(series + "_total", metrics.get(series, 0.0))


def spec_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    """Speculative counters between two scrapes, with :func:`spec_figures`
    over them. ``specplug``: every ``specplug:`` counter that moved."""
    d = {k: _total(after, s) - _total(before, s) for k, s in SPEC_SERIES.items()}
    out = {k: int(round(v)) for k, v in d.items()}
    out.update(spec_figures(out))
    out["specplug"] = {}
    for key, value in after.items():
        if key.startswith("specplug:") and "{" not in key and not key.endswith("_created"):
            step = value - before.get(key, 0.0)
            if step:
                out["specplug"][key.removeprefix("specplug:").removesuffix("_total")] = step
    return out


def spec_figures(counts: dict) -> dict:
    """From a point's counters: ``tau``, tokens per target pass of a request
    (generated / (generated - accepted): each pass yields 1 + its accepted
    tokens, drafted or not, so it falls when drafting stops);
    ``mean_accepted_length``, vLLM's 1 + accepted / drafts (it leaves out
    the passes without a draft); ``draft_share``: passes that verified a
    draft; ``mean_tree_size``: draft tokens per draft."""
    generated, accepted, drafts = (counts[k] for k in ("generation_tokens", "accepted_tokens",
                                                        "drafts"))
    passes = generated - accepted
    return {"tau": generated / passes if passes > 0 else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts > 0 else None,
            "draft_share": drafts / passes if passes > 0 else None,
            "mean_tree_size": counts["draft_tokens"] / drafts if drafts > 0 else None}


def latency_figures(bench: dict) -> dict:
    """``{"ttft_ms": {"mean", "p50", "p99"}, ...}`` from a bench result."""
    out = {}
    for name in LATENCIES:
        fig = {"mean": bench.get(f"mean_{name}_ms")}
        for p in PERCENTILES:
            fig[f"p{p}"] = bench.get(f"p{p}_{name}_ms")
        out[f"{name}_ms"] = fig
    return out


def point_record(method: str, kind: str, point: Point, bench: dict, spec: dict | None,
                 budget: dict | None = None) -> dict:
    """One record of the sweep's JSON: vLLM's own throughput and latency
    figures plus the server's speculative counters over the point."""
    errors = [e for e in bench.get("errors") or [] if e]
    rec = {"method": method, "method_kind": kind, "dataset": point.dataset,
           "temperature": point.temperature, "load": point.kind, "value": point.value,
           "num_prompts": len(point.prompts), "completed": bench.get("completed"),
           "failed": bench.get("failed", len(errors)), "first_error": errors[0] if errors else None,
           "duration_s": bench.get("duration"),
           "output_throughput": bench.get("output_throughput"),
           "request_throughput": bench.get("request_throughput"),
           "total_output_tokens": bench.get("total_output_tokens"),
           "max_concurrent_requests": bench.get("max_concurrent_requests"),
           **latency_figures(bench), "spec": spec,
           # vLLM's client reads the same counters itself: a cross-check
           "bench_spec": {k: v for k, v in bench.items() if k.startswith("spec_decode_")
                          and not isinstance(v, list)} or None}
    if budget is not None:
        rec["budget"] = budget
    return rec


BUDGET_KEYS = ("steps", "chosen_nodes", "proposed_nodes", "zero_steps", "gated_steps",
               "explore_steps", "gate_closings")
GATE_KEYS = ("gate_log", "gate_verdicts", "draft_ms", "side_ms", "step_ms_by_rows")
"""The budget's levels at a point's end: its last gate verdicts and the
costs it judged them with (``BudgetController.as_dict``)."""
ENGINE_KEYS = ("steps", "collect_seconds", "propose_seconds", "propose_calls")
ENGINE_SOURCES = ("source_nodes", "source_accepted")


def _delta(new, old):
    return round(new - (old or 0), 6) if isinstance(new, (int, float)) else None


def budget_deltas(before: dict | None, after: dict | None) -> dict | None:
    """The cost-aware budget's counters over a point (``specplug_stats``'s
    ``budget``; None for engines without one), the gate's last verdicts at
    its end (``gate``), and where the engine's time went (``engine``: steps,
    seconds collecting and proposing drafts, per-source nodes and accepted
    tokens), so a point that lost can be read as gated, drafting or paying."""
    if not isinstance(after, dict) or not isinstance(after.get("budget"), dict):
        return None
    old = (before or {}).get("budget") or {}
    new = after["budget"]
    out = {k: new[k] - old.get(k, 0) for k in BUDGET_KEYS
           if isinstance(new.get(k), (int, float))}
    out["gate"] = {k: new[k] for k in GATE_KEYS if k in new}
    prev = before or {}
    engine = {k: _delta(after.get(k), prev.get(k)) for k in ENGINE_KEYS
              if isinstance(after.get(k), (int, float))}
    for key in ENGINE_SOURCES:
        if isinstance(after.get(key), dict):
            was = prev.get(key) or {}
            engine[key] = {s: n - was.get(s, 0) for s, n in after[key].items()
                           if n - was.get(s, 0)}
    out["engine"] = engine
    return out
