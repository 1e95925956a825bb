"""Tau per request for ``eagle3_tree`` and the ``reader`` ablations, lean.

    python -m benchmarks.reader_tau --configs benchmarks/configs/reader.json \\
        --labels eagle3_tree@n16,reader@ctx,reader@ctxdeep,reader@ds,reader@n16 \\
        --suites humaneval:odd,specbench:summarization,specbench:rag,specbench:math_reasoning \\
        --limit 1 --max-tokens 48 --out benchmarks/results/reader_tau.json

``benchmarks.run`` is the reference harness (a process per method, warm-up,
a ``none`` baseline, timings). On a machine too loaded for it (plain
decoding at well under 1 token/s) this measures tau alone: one engine per
label (float32, greedy, eager, in-process), every suite's prompts in one
``generate``, and per request ``tau = generated tokens / target passes``
(the passes counted as the steps in which the method was asked to draft
after a sampled token). Outputs are compared across labels; each method's
losslessness against plain decoding is what its engine tests check.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _run(model: str, label: str, options: dict, prompts: list[list[int]],
         max_tokens: int) -> tuple[list[list[int]], list[int], float, dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_specplug.config import TOOL_KV_CACHE_BYTES

    from vllm_specplug import registry

    method = label.split("@", 1)[0]
    cls = registry.get(method)
    passes: dict[str, int] = {}
    orig = cls.propose

    def propose(self, batch):
        for r in batch:
            if r.sampled:  # vLLM's internal id: "<request_id>-<8 random chars>"
                rid = r.req_id.rsplit("-", 1)[0]
                passes[rid] = passes.get(rid, 0) + 1
        return orig(self, batch)

    cls.propose = propose
    t0 = time.time()
    try:
        llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0,
                  enforce_eager=True, max_num_seqs=len(prompts), kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES,
                  speculative_config={"method": method, **options})
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_tqdm=False)
        stats = llm.collective_rpc("specplug_stats")[0]
    finally:
        cls.propose = orig
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    steps = [passes.get(o.request_id, 0) for o in outs]
    return tokens, steps, time.time() - t0, stats


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from benchmarks import suites
    from vllm_specplug.models.reference import reference_model_path

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="benchmarks/configs/reader.json")
    ap.add_argument("--labels", required=True)
    ap.add_argument("--suites", default="humaneval:odd,specbench:summarization,"
                                        "specbench:rag,specbench:math_reasoning")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    model = reference_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    prompts, which = [], []
    for name in args.suites.split(","):
        s = suites.tokenize(suites.load(name), tok, args.limit, 2048 - args.max_tokens)
        prompts += s.prompts
        which += [name] * len(s.prompts)
    with open(args.configs, encoding="utf-8") as f:
        configs = json.load(f)
    doc = json.load(open(args.out)) if os.path.exists(args.out) else {"records": []}
    doc["run"] = {"model": os.path.basename(model), "dtype": "float32", "greedy": True,
                  "suites": args.suites, "limit": args.limit, "max_tokens": args.max_tokens,
                  "note": "tau only; machine heavily shared"}
    for label in args.labels.split(","):
        opts = {k: (os.path.expanduser(v) if k == "datastore" else v)
                for k, v in configs[label].items()}
        tokens, steps, secs, stats = _run(model, label, opts, prompts, args.max_tokens)
        per_suite: dict[str, list[int]] = {}
        for name, t, s in zip(which, tokens, steps):
            g, p = per_suite.setdefault(name, [0, 0])
            per_suite[name] = [g + len(t), p + s]
        doc["records"] = [r for r in doc["records"] if r["label"] != label]
        doc["records"].append({
            "label": label, "options": configs[label], "seconds": round(secs, 1),
            "tau": {k: g / max(1, p) for k, (g, p) in per_suite.items()},
            "source_accepted": stats.get("source_accepted"),
            "source_nodes": stats.get("source_nodes"),
            "method": {k: v for k, v in stats.get("method", {}).items()
                       if isinstance(v, (int, float, str))},
            "outputs": tokens})
        ref = doc["records"][0]["outputs"]
        doc["records"][-1]["identical_to_first"] = tokens == ref
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        print(label, {k: round(v, 3) for k, v in doc["records"][-1]["tau"].items()},
              "identical" if tokens == ref else "DIFFERENT", f"{secs:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
