"""`specplug selftest`: the lossless checks, on whatever device is present.

Run it first on a new GPU, vLLM build or attention backend. For every
registered method it starts vLLM with that method and checks that greedy
output is token-for-token the plain decoding output, at batch 1 and batch 8;
then one sampling check (temperature 1, tree verification through the
``oracle`` method's trie of earlier samples) compares the emitted tokens'
distribution with plain sampling (chi-square homogeneity). It prints a
pass/fail table, what every engine really ran with (attention backend, CUDA
graph mode, dtype), and exits 1 if anything failed.

A check cannot pass vacuously:

* A greedy row passes only if its engine verified trees (``tree_drafts >
  0`` over its batches); identical output from an engine that never drafted
  proves nothing and fails. The cost-aware gate is turned off
  (``cost_aware`` False unless ``--options`` sets it) so every method drafts
  what it can. The ``oracle`` method always runs first, as the control: its
  trees hold the true continuation in a shuffled order, so it verifies
  trees and moves accepted nodes in the KV cache on any device, and its row
  also requires ``kv_moves > 0`` (a method whose accepted paths all lay in
  place moved none, which its row says).
* A method whose optional package or EAGLE-3 head is missing (no head ships
  for a ``--model``) is a SKIP row with the reason, never a FAIL.

Runs: on CPU one float32 run. On CUDA (no ``--dtype``/``--attention-backend``
given) two: float32 with TRITON_ATTN, compared token for token, and bfloat16
with FLASH_ATTN (the usual serving path), where output equality is only
expected away from near-ties: a divergence where plain decoding's top-2
logit margin is below ``NEAR_TIE[bfloat16]`` passes with the margin shown.
The plain engine runs in the tree engines' CUDA graph mode (PIECEWISE), so
the two differ only in speculation. On any mismatch the row names the first
diverging token and plain decoding's logit margin there.

Defaults: the reference model (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

PROMPTS = [
    "List the planets of the solar system in order, then list them again in reverse:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Write a short story about a robot who learns to paint.",
    "Translate to French: Good morning, how are you today? I am fine, thank you.",
    "Q: What is 17 * 23? Explain step by step.\nA:",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of",
    "<html>\n<head>\n<title>My page</title>\n</head>\n<body>\n",
]

# Plain decoding's top-2 logit margin below which a divergence is a near-tie
# the dtype's rounding can flip (float32: none is excused).
NEAR_TIE = {"float32": 0.0, "bfloat16": 0.1, "float16": 0.02}

# Methods that never draft (the plugin's engine without speculation): their
# greedy row checks equality alone.
DRAFTS_NOTHING = frozenset({"plain"})

# Methods that need a package the base install does not bring.
OPTIONAL_PACKAGES = {"suffix_tree": ("arctic_inference", "pip install arctic-inference==0.3.0")}


@dataclass(frozen=True)
class RunPlan:
    """One pass over every method: the engines' dtype and attention backend."""

    dtype: str
    backend: str | None  # None: vLLM's choice
    exact: bool  # greedy output must match plain decoding at every token

    @property
    def label(self) -> str:
        return f"{self.dtype}/{self.backend or 'default'}"


def plan_runs(dtype: str | None, backend: str | None, device_type: str) -> list[RunPlan]:
    """The runs for ``--dtype``/``--attention-backend`` on ``device_type``."""
    if dtype is not None or backend is not None or device_type != "cuda":
        dtype = dtype or "float32"
        return [RunPlan(dtype, backend, NEAR_TIE.get(dtype, 0.0) == 0.0)]
    return [RunPlan("float32", "TRITON_ATTN", True), RunPlan("bfloat16", "FLASH_ATTN", False)]


def skip_reason(name: str, config_cls, opts: dict, model: str) -> str | None:
    """Why method ``name`` cannot run here (a SKIP row), or None."""
    missing = [f for f, i in config_cls.model_fields.items()
               if i.is_required() and f not in opts]
    if missing:
        return f"needs option(s) {', '.join(missing)} (--options)"
    package = OPTIONAL_PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package[0]) is None:
        return f"needs {package[0]} ({package[1]})"
    if "head" in config_cls.model_fields and not opts.get("head"):
        from vllm_specplug.eagle3 import default_head_for

        if default_head_for(model) is None:
            return (f"no EAGLE-3 head ships for this model; pass "
                    f"'{{\"{name}\": {{\"head\": DIR}}}}' in --options")
    return None


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def top2_margin(position_logprobs: dict | None) -> float | None:
    """Top-1 minus top-2 log-probability (= logit gap) from one position's
    ``{token: logprob}``, None if fewer than two are known."""
    if not position_logprobs or len(position_logprobs) < 2:
        return None
    best = sorted(position_logprobs.values(), reverse=True)
    return best[0] - best[1]


def compare_batch(got: list[list[int]], want: list[list[int]], margins, plan: RunPlan):
    """(failed, notes) for one batch: ``margins[r][p]`` is plain decoding's
    top-2 margin at token p of request r (None where unknown)."""
    notes, failed = [], False
    for r, (g, w) in enumerate(zip(got, want)):
        pos = first_divergence(g, w)
        if pos is None:
            continue
        margin = margins[r][pos] if margins and pos < len(margins[r]) else None
        tie = margin is not None and margin < NEAR_TIE.get(plan.dtype, 0.0)
        failed |= plan.exact or not tie
        shown = "unknown" if margin is None else f"{margin:.4g}"
        notes.append(f"request {r} differs from token {pos} (plain logit margin {shown}"
                     f"{', a near-tie' if tie else ''})")
    return failed, notes


def greedy_verdict(batches: dict, plain: dict, stats: dict, plan: RunPlan,
                   require: str = "trees"):
    """The greedy row of one method: ``batches[b]`` its outputs at batch b,
    ``plain[b]`` = (outputs, margins) of plain decoding, ``stats`` the tree
    counters over these batches. ``require``: the evidence a PASS needs,
    ``"trees"`` (trees verified), ``"moves"`` (trees verified and accepted
    nodes moved: the oracle control) or ``"none"`` (a method that never
    drafts). Returns (status, detail)."""
    failed, notes = False, []
    for b, got in sorted(batches.items()):
        f, n = compare_batch(got, plain[b][0], plain[b][1], plan)
        failed |= f
        notes += [f"batch {b}: {x}" for x in n]
    drafts, moves = stats.get("tree_drafts", 0), stats.get("kv_moves", 0)
    evidence = f"{drafts} trees verified, {moves} nodes moved"
    if failed:
        return "FAIL", "; ".join(notes[:3]) + f"; {evidence}"
    if require == "none":
        evidence = "no speculation (by design)"
    elif drafts <= 0 or (require == "moves" and moves <= 0):
        return "FAIL", (f"output identical but nothing was exercised ({evidence}): "
                        "the check proves nothing")
    elif moves <= 0:
        evidence += " (every accepted path was in place; the oracle row moves nodes)"
    tokens = sum(len(o) for got in batches.values() for o in got)
    same = "identical" if not notes else "identical up to near-ties: " + "; ".join(notes[:2])
    return "PASS", f"{tokens} tokens {same}; {evidence}"


def method_options(name: str, user: dict, reference_file: str) -> dict:
    """The options a method runs with in the greedy check."""
    opts = dict(user)
    opts.setdefault("cost_aware", False)  # the gate must not leave the check empty
    if name == "oracle":
        opts.setdefault("reference_file", reference_file)
        opts.setdefault("mode", "random")
        opts.setdefault("shuffle", True)  # off-path accepted nodes: the KV move runs
    return opts


def stats_delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("tree_drafts", "kv_moves")}


def homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that samples ``a`` and ``b`` come from one
    distribution (tokens seen fewer than 10 times pooled)."""
    import torch

    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rows = [[c[k] for k in keys] + [sum(v for k, v in c.items() if k not in keys)]
            for c in (ca, cb)]
    cols = [j for j in range(len(rows[0])) if rows[0][j] + rows[1][j] > 0]
    if len(cols) < 2:
        return 1.0
    table = torch.tensor([[r[j] for j in cols] for r in rows], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor((len(cols) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


# ------------------------------------------------------------------ engines


def _worker_info(worker) -> dict:
    """Runs inside a vLLM worker: what the engine really uses."""
    from vllm.model_executor.layers.attention import Attention

    runner = worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    backend = next((type(layer.impl).__name__ for layer in ctx.values()
                    if isinstance(layer, Attention)), "?")
    mode = runner.compilation_config.cudagraph_mode
    device = str(runner.device)
    if runner.device.type == "cuda":
        import torch

        device = torch.cuda.get_device_name(runner.device)
    return {"backend": backend, "graph_mode": getattr(mode, "name", str(mode)),
            "device": device, "dtype": str(runner.model_config.dtype).replace("torch.", "")}


class LLMEngine:
    """The calls the selftest makes on one ``vllm.LLM``."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def info(self) -> dict:
        return self.llm.collective_rpc(_worker_info)[0]

    def stats(self) -> dict:
        return self.llm.collective_rpc("specplug_stats")[0]

    def greedy(self, prompts, max_tokens, logprobs: bool = False):
        """(prompt ids, output ids, per-token top-2 margins or None)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2 if logprobs else None)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        margins = [[top2_margin({t: lp.logprob for t, lp in pos.items()})
                    for pos in (o.outputs[0].logprobs or [])] for o in outs]
        return ([list(o.prompt_token_ids) for o in outs],
                [list(o.outputs[0].token_ids) for o in outs],
                margins if logprobs else None)

    def sample(self, prompt, n):
        from vllm import SamplingParams

        # Unseeded: vLLM 0.32's CPU worker fails on a seeded request whose
        # prefill is chunked ("CPU Generator does not use offset").
        params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
        outs = self.llm.generate([prompt] * n, params, use_tqdm=False)
        return ([list(o.prompt_token_ids) for o in outs],
                [list(o.outputs[0].token_ids) for o in outs])


@contextlib.contextmanager
def open_engine(model, spec, args, plan: RunPlan):
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.platforms import current_platform

    cuda = current_platform.device_type == "cuda"
    eager = args.enforce_eager
    if eager is None:  # CPU: torch.compile start-up is slow and tests nothing here
        eager = not cuda
    opts = dict(dtype=plan.dtype, max_model_len=1024, seed=0, enforce_eager=eager,
                gpu_memory_utilization=0.5)
    if plan.backend:
        opts["attention_backend"] = plan.backend
    if cuda and not eager and spec is None:
        # the tree engines' graph mode: plain and tree runs then differ
        # only in speculation, not in which kernels a graph replays
        opts["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    llm = LLM(model=model, speculative_config=spec, **opts)
    try:
        yield LLMEngine(llm)
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


# ------------------------------------------------------------------ the run


def method_names(requested: list[str] | None) -> list[str]:
    """The oracle first (the control that always drafts and moves), then
    the requested methods (default: every registered one)."""
    from vllm_specplug import registry

    names = requested or registry.names()
    return ["oracle"] + [n for n in names if n != "oracle"]


def plain_run(model, args, plan: RunPlan, engine, tmp: str, want_samples: bool):
    """Plain decoding: the engine's info, ``{batch: (outputs, margins)}``,
    the oracle's reference file, and (first run only) two sample sets."""
    with engine(model, None, args, plan) as eng:
        info = eng.info()
        plain, prompts = {}, None
        for b in (1, 8):
            prompts, outs, margins = eng.greedy(PROMPTS[:b], args.max_tokens, logprobs=True)
            plain[b] = (outs, margins)
        samples = None
        if want_samples and args.samples:
            samples = (eng.sample(PROMPTS[6], args.samples),
                       eng.sample(PROMPTS[6], args.samples)[1])
    ref = os.path.join(tmp, f"reference-{plan.dtype}.json")
    with open(ref, "w") as f:
        json.dump([p + o for p, o in zip(prompts, plain[8][0])], f)
    return info, plain, ref, samples


def method_row(name: str, plan: RunPlan, model, args, engine, plain, ref, user: dict):
    """One method's greedy row and its engine's info (None if it did not start)."""
    from vllm_specplug import registry

    check = f"greedy {plan.label}"
    try:
        cls = registry.get(name)
        opts = method_options(name, user.get(name, {}), ref)
        why = skip_reason(name, cls.config_cls, opts, model)
        if why is not None:
            return (name, check, "SKIP", why), None
        spec = {"method": name, "num_speculative_tokens": args.num_speculative_tokens,
                **opts}
        with engine(model, spec, args, plan) as eng:
            info, before = eng.info(), eng.stats()
            batches = {b: eng.greedy(PROMPTS[:b], args.max_tokens)[1] for b in (1, 8)}
            after = eng.stats()
    except Exception as e:  # report and go on with the other methods
        return (name, check, "FAIL", f"{type(e).__name__}: {e}"), None
    require = "none" if name in DRAFTS_NOTHING else "moves" if name == "oracle" else "trees"
    status, detail = greedy_verdict(batches, plain, stats_delta(after, before), plan, require)
    if "mean_accepted_length" in after:
        detail += f"; mean accepted length {after['mean_accepted_length']:.2f}"
    return (name, check, status, detail), info


def sampling_row(model, args, plan: RunPlan, engine, tmp: str, samples):
    """Tree sampling (the oracle's trie of earlier samples) against plain
    sampling, the distribution of the 2nd and 3rd tokens: (row, engine info)."""
    (prompts, seen), plain_samples = samples
    path = os.path.join(tmp, "samples.json")
    with open(path, "w") as f:
        json.dump([p + o for p, o in zip(prompts, seen)], f)
    spec = {"method": "oracle", "num_speculative_tokens": args.num_speculative_tokens,
            "mode": "trie", "max_depth": 2, "reference_file": path}
    try:
        with engine(model, spec, args, plan) as eng:
            info = eng.info()
            tree = eng.sample(PROMPTS[6], args.samples)[1]
            stats = eng.stats()
    except Exception as e:
        return ("oracle (trie)", "sampling T=1", "FAIL", f"{type(e).__name__}: {e}"), None
    ps = [homogeneity_pvalue([s[pos] for s in plain_samples], [s[pos] for s in tree])
          for pos in (1, 2)]
    ok = min(ps) > 1e-3 and stats.get("tree_drafts", 0) > 0
    return ("oracle (trie)", "sampling T=1", "PASS" if ok else "FAIL",
            f"chi-square p={ps[0]:.3g}, {ps[1]:.3g} (tokens 2, 3); "
            f"{stats.get('tree_drafts', 0)} trees"), info


def print_report(model, device, engines, rows, seconds) -> int:
    try:
        import vllm

        version = vllm.__version__
    except ImportError:
        version = "?"
    print(f"\nspecplug selftest  vLLM {version}  model {model}  device {device}"
          f"  ({seconds:.0f} s)\nengines (what each really ran with):")
    label_w = max([len(label) for label, _ in engines] + [8])
    for label, info in engines:
        print(f"  {label:<{label_w}}  {info.get('backend')}  cudagraph_mode "
              f"{info.get('graph_mode')}  dtype {info.get('dtype')}")
    width = max([len(r[0]) for r in rows] + [6])
    check_w = max([len(r[1]) for r in rows] + [5])
    print(f"\n{'method':<{width}}  {'check':<{check_w}}  result  detail")
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:<{check_w}}  {r[2]:<6}  {r[3]}")
    failed = [r for r in rows if r[2] == "FAIL"]
    print(f"\n{'FAILED' if failed else 'all checks passed'}"
          f" ({len(failed)} failed, {sum(r[2] == 'SKIP' for r in rows)} skipped)")
    return 1 if failed else 0


def run(args, engine=open_engine, device_type: str | None = None) -> int:
    """The checks, with ``specplug selftest``'s arguments (``args``); 1 if any
    failed. ``engine``/``device_type``: how engines start and on what (tests
    pass fakes)."""
    # _worker_info travels to the engine's worker process as a function;
    # vLLM only pickles functions when allowed (this process's own engines).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = args.model
    if model is None:
        from vllm_specplug.models.reference import reference_model_path

        model = reference_model_path()
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type
    user = json.loads(args.options)
    plans = plan_runs(args.dtype, args.attention_backend, device_type)
    rows, engines, device, t0 = [], [], device_type, time.time()
    tmp = tempfile.mkdtemp(prefix="specplug-selftest-")
    for i, plan in enumerate(plans):
        info, plain, ref, samples = plain_run(model, args, plan, engine, tmp, i == 0)
        engines.append((f"baseline (vLLM alone) {plan.label}", info))
        device = info.get("device", device)
        for name in method_names(args.methods):
            row, info = method_row(name, plan, model, args, engine, plain, ref, user)
            rows.append(row)
            if info is not None:
                engines.append((f"{name} {plan.label}", info))
        if samples is not None:
            row, info = sampling_row(model, args, plan, engine, tmp, samples)
            rows.append(row)
            if info is not None:
                engines.append((f"oracle (trie) {plan.label}", info))
    return print_report(model, device, engines, rows, time.time() - t0)
