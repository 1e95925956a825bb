"""The cost-aware gate step by step: one fresh engine (compiled, float32,
``--batch``, 1 by default), a short warm-up on the suite's first prompt, the budget's learning
reset (as ``benchmarks.run`` does), then the suite's prompts one at a time.
Every step's proposer time, whether it drafted or explored, and every
judgement of the gate (the step's surplus, its average, open or closed, the
skips ahead, the drafting cost charged) go to a JSON trace; one line of
totals is printed.

``--contended-warm-up`` runs three busy processes beside the warm-up (the
cores shared, as when several engines warm up at once), stopped before the
timed prompts: whatever a method keeps of what it measured there shows in
the prompts that follow.

    python -m benchmarks.studies.gate_trace --method auto --suite specbench:qa \\
        --out /tmp/gate_auto_qa.json [--contended-warm-up]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HOG = "import torch\nx = torch.randn(800, 800)\nwhile True: x @ x"


def _trace_gate(trace: list) -> None:
    """Record every gate event into ``trace`` (patches ``DraftGate``; the
    engine runs in this process)."""
    from vllm_specplug.engine.budget import gate as g

    judge, observe, now = g.DraftGate.judge, g.DraftGate.observe_propose, g.DraftGate.draft_now

    def traced_judge(self, pays=False, step_seconds=0.0, whole_batch=False, surplus=None):
        out = judge(self, pays, step_seconds, whole_batch, surplus)
        trace.append({"event": "judge", "surplus_ms": 1e3 * (surplus or 0.0),
                      "average_ms": 1e3 * (self.surplus or 0.0), "open": self.open,
                      "skip": self._skip, "draft_ms": 1e3 * self.draft_seconds})
        return out

    def traced_observe(self, seconds, drafted, requests=1):
        trace.append({"event": "propose", "ms": 1e3 * seconds, "drafted": drafted,
                      "exploring": self.exploring, "t": time.perf_counter()})
        return observe(self, seconds, drafted, requests)

    def traced_now(self):
        out = now(self)
        trace.append({"event": "draft_now", "answer": out})
        return out

    g.DraftGate.judge = traced_judge
    g.DraftGate.observe_propose = traced_observe
    g.DraftGate.draft_now = traced_now

    from vllm_specplug.engine.budget import controller as c

    observe_step, learn = c.BudgetController.observe_step, c.BudgetController.learn

    def traced_step(self, rows, seconds):
        trace.append({"event": "step", "rows": rows, "forward_ms": 1e3 * seconds,
                      "t": time.perf_counter()})
        return observe_step(self, rows, seconds)

    def traced_learn(self, req_id, token_ids, accepted=None):
        if accepted is not None:
            trace.append({"event": "accepted", "tokens": accepted})
        return learn(self, req_id, token_ids, accepted)

    c.BudgetController.observe_step = traced_step
    c.BudgetController.learn = traced_learn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="auto")
    ap.add_argument("--suite", default="specbench:qa")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1,
                    help="prompts per generate call (the engine's batch)")
    ap.add_argument("--contended-warm-up", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from benchmarks.machine import describe, machine_info
    from vllm_specplug import suites
    from vllm_specplug.models.reference import reference_model_path

    print(describe(machine_info()))
    model = reference_model_path()
    suite = suites.tokenize(suites.load(args.suite), AutoTokenizer.from_pretrained(model),
                            args.limit, 1200)
    trace: list = []
    _trace_gate(trace)
    llm = LLM(model, dtype="float32", max_model_len=1400, seed=0, max_num_seqs=args.batch,
              speculative_config={"method": args.method,
                                  "num_speculative_tokens": args.num_speculative_tokens})
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(3)] \
        if args.contended_warm_up else []
    try:
        for n in (64, 200, 400):  # the first prompt, repeated to the length
            ids = (suite.prompts[0] * (1 + n // len(suite.prompts[0])))[:n]
            llm.generate([TokensPrompt(prompt_token_ids=ids)],
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
    finally:
        for h in hogs:
            h.kill()
    llm.collective_rpc("specplug_reset_budget")
    trace.clear()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    for at in range(0, len(suite.prompts), args.batch):
        trace.append({"event": "prompt"})
        llm.generate([TokensPrompt(prompt_token_ids=ids)
                      for ids in suite.prompts[at:at + args.batch]], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.collective_rpc("specplug_stats")[0]
    budget = stats.get("budget", {})  # plain decoding has none
    totals = {"method": args.method, "suite": args.suite,
              "contended_warm_up": args.contended_warm_up, "wall_seconds": wall,
              "accepted_tokens": stats["accepted_tokens"], "steps": budget.get("steps"),
              "gated_steps": budget.get("gated_steps"),
              "explore_steps": budget.get("explore_steps")}
    print(json.dumps(totals))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"totals": totals, "trace": trace}, f)


if __name__ == "__main__":
    main()
