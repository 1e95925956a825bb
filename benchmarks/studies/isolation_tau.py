"""What tenant isolation costs in acceptance: tau per ``isolation`` mode.

``python -m benchmarks.studies.isolation_tau [--methods suffix_tree,recycle]
[--tenants 3] [--limit 6] [--max-tokens 96] [--out benchmarks/results/isolation_tau.json]``

A mixed workload where several tenants ask the same questions (prompts
interleaved from a few suites; every tenant asks each prompt in turn, one
request at a time, each tenant with its own ``cache_salt``) is generated
greedily by one engine per method and mode (``salt``, ``off``, ``strict``).
Under ``off`` a later tenant drafts from an earlier tenant's answer; under
``salt`` only from its own past; under ``strict`` from nothing but its own
request. Tau (tokens per target pass, generated / (generated − accepted))
is counted from vLLM's counters per request (tree size pinned:
``cost_aware`` off), pooled per mode and split into
each prompt's first asker and the later ones. Every output is compared with
the ``off`` run's (all modes must generate the same tokens: verification
is exact). Tau only: no timing, so it can run on a busy machine.
"""

from __future__ import annotations

import argparse
import gc
import os

from benchmarks import result_file

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODES = ("salt", "off", "strict")
SUITES = ("specbench:qa", "specbench:summarization", "specbench:translation", "humaneval:odd")


def workload(tokenizer, suites, limit: int, tenants: int) -> list[tuple[int, int, list[int]]]:
    """(prompt index, tenant, prompt ids): ``limit`` prompts taken in turn
    from ``suites``, each asked by every tenant before the next prompt."""
    from vllm_specplug import suites as S

    per_suite = [S.tokenize(S.load(name), tokenizer, limit, 1024).prompts for name in suites]
    prompts = [ids for group in zip(*per_suite) for ids in group][:limit]
    return [(i, t, ids) for i, ids in enumerate(prompts) for t in range(tenants)]


def counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}


def run_mode(model: str, method: str, mode: str, requests, max_tokens: int) -> list[dict]:
    """One engine: each request alone, its tokens and accepted count."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    # a pinned tree size: the budget's gate would make tau depend on step times
    spec = {"method": method, "isolation": mode, "cost_aware": False}
    llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0,
              speculative_config=spec, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = []
    for prompt_idx, tenant, ids in requests:
        before = counters(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=f"tenant-{tenant}")],
                           params, use_tqdm=False)[0]
        after = counters(llm)
        rows.append({"prompt": prompt_idx, "tenant": tenant,
                     "tokens": list(out.outputs[0].token_ids),
                     "accepted": int(after.get("vllm:spec_decode_num_accepted_tokens", 0)
                                     - before.get("vllm:spec_decode_num_accepted_tokens", 0))})
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return rows


def tau(rows: list[dict]) -> float | None:
    generated = sum(len(r["tokens"]) for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    return generated / (generated - accepted) if generated > accepted else None


def summarize(rows: list[dict]) -> dict:
    first = [r for r in rows if r["tenant"] == 0]
    later = [r for r in rows if r["tenant"] > 0]
    return {"tau": tau(rows), "tau_first_asker": tau(first), "tau_later_askers": tau(later),
            "requests": len(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the reference model")
    ap.add_argument("--methods", default="suffix_tree,recycle")
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--limit", type=int, default=6, help="prompts in the workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/isolation_tau.json")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.machine import describe, git_info, machine_info
    from vllm_specplug.models.reference import reference_model_path

    model = args.model or reference_model_path()
    machine = machine_info()
    print(describe(machine), flush=True)
    requests = workload(AutoTokenizer.from_pretrained(model), args.suites.split(","),
                        args.limit, args.tenants)
    results = []
    for method in args.methods.split(","):
        runs = {mode: run_mode(model, method, mode, requests, args.max_tokens) for mode in MODES}
        reference = [r["tokens"] for r in runs["off"]]
        for mode, rows in runs.items():
            same = [r["tokens"] for r in rows] == reference
            results.append({"method": method, "isolation": mode, "identical": same,
                            **summarize(rows)})
            print(f"{method:<12} {mode:<7} tau {results[-1]['tau']:.2f} "
                  f"(first asker {results[-1]['tau_first_asker']:.2f}, later "
                  f"{results[-1]['tau_later_askers']:.2f})  identical {same}", flush=True)
    doc = {"study": "isolation_tau", "machine": machine, "git": git_info(),
           "command": "python -m benchmarks.studies.isolation_tau "
                      + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
           "workload": {"suites": args.suites.split(","), "prompts": args.limit,
                        "tenants": args.tenants, "max_tokens": args.max_tokens,
                        "dtype": "float32", "greedy": True},
           "results": results}
    result_file.write(doc, args.out)
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
