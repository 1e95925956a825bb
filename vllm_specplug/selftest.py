"""`specplug selftest`: the lossless checks, on whatever device is present.

Run it first on a new GPU, vLLM build or attention backend. For every
registered method it starts vLLM with that method and checks that greedy
output is token-for-token the plain decoding output, at batch 1 and batch 8;
then one sampling check (temperature 1, tree verification through the
``oracle`` method's trie of earlier samples) compares the emitted tokens'
distribution with plain sampling (chi-square homogeneity). It prints a
pass/fail table with the vLLM version, device, attention backend and CUDA
graph mode the engine really ran with, and exits 1 if anything failed.

Defaults: the reference model (SmolLM2-135M-Instruct) in float32 (equality
tests compare exact tokens; half precision may differ from plain decoding in
the last bits of a logit, which is not a specplug bug but makes the check
meaningless).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
from collections import Counter

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
            "device": device}


@contextlib.contextmanager
def _engine(model, spec, args):
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm.platforms import current_platform

    eager = args.enforce_eager
    if eager is None:  # CPU: torch.compile start-up is slow and tests nothing here
        eager = current_platform.device_type != "cuda"
    opts = dict(dtype=args.dtype, max_model_len=1024, seed=0, enforce_eager=eager,
                gpu_memory_utilization=0.5)
    if args.attention_backend:
        opts["attention_backend"] = args.attention_backend
    llm = LLM(model=model, speculative_config=spec, **opts)
    try:
        yield llm
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids)
                                                       for o in outs]


def _sample(llm, prompt, n):
    from vllm import SamplingParams

    # Unseeded: vLLM 0.32's CPU worker fails on a seeded request whose
    # prefill is chunked ("CPU Generator does not use offset").
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids)
                                                       for o in outs]


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


def run(args) -> int:
    """The checks, with ``specplug selftest``'s arguments (``args``); 1 if any failed."""
    # _worker_info travels to the engine's worker process as a function;
    # vLLM only pickles functions when allowed (this process's own engines).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm

    from vllm_specplug import registry

    model = args.model
    if model is None:
        from vllm_specplug.models.reference import reference_model_path

        model = reference_model_path()
    extra = json.loads(args.options)
    k = args.num_speculative_tokens
    rows: list[tuple[str, str, str, str]] = []
    info: dict = {}
    t0 = time.time()

    with _engine(model, None, args) as llm:
        info = llm.collective_rpc(_worker_info)[0]
        plain = {1: _greedy(llm, PROMPTS[:1], args.max_tokens),
                 8: _greedy(llm, PROMPTS, args.max_tokens)}
        if args.samples:
            seen = _sample(llm, PROMPTS[6], args.samples)
            plain_samples = _sample(llm, PROMPTS[6], args.samples)[1]

    tmp = tempfile.mkdtemp(prefix="specplug-selftest-")
    ref = os.path.join(tmp, "reference.json")
    with open(ref, "w") as f:
        json.dump([p + o for p, o in zip(*plain[8])], f)

    for name in args.methods or registry.names():
        cls = registry.get(name)
        opts = dict(extra.get(name, {}))
        if name == "oracle":
            opts.setdefault("reference_file", ref)
        missing = [f for f, i in cls.config_cls.model_fields.items()
                   if i.is_required() and f not in opts]
        if missing:
            rows.append((name, "greedy b1/b8", "SKIP",
                         f"needs option(s) {', '.join(missing)} (--options)"))
            continue
        spec = {"method": name, "num_speculative_tokens": k, **opts}
        try:
            with _engine(model, spec, args) as llm:
                info.setdefault("spec_graph_mode", llm.collective_rpc(_worker_info)[0]
                                ["graph_mode"])
                for batch in (1, 8):
                    got = _greedy(llm, PROMPTS[:batch], args.max_tokens)[1]
                    want = plain[batch][1]
                    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                    rows.append((name, f"greedy batch {batch}",
                                 "FAIL" if bad else "PASS",
                                 f"differs in request(s) {bad}" if bad else
                                 f"{sum(map(len, got))} tokens identical"))
                stats = llm.collective_rpc("specplug_stats")[0]
                rows[-1] = rows[-1][:3] + (
                    rows[-1][3] + f"; mean accepted length "
                    f"{stats['mean_accepted_length']:.2f}",)
        except Exception as e:  # report and go on with the other methods
            rows.append((name, "start-up/greedy", "FAIL", f"{type(e).__name__}: {e}"))

    if args.samples:
        with open(os.path.join(tmp, "samples.json"), "w") as f:
            json.dump([p + o for p, o in zip(*seen)], f)
        spec = {"method": "oracle", "num_speculative_tokens": k, "mode": "trie",
                "max_depth": 2, "reference_file": os.path.join(tmp, "samples.json")}
        try:
            with _engine(model, spec, args) as llm:
                tree = _sample(llm, PROMPTS[6], args.samples)[1]
                stats = llm.collective_rpc("specplug_stats")[0]
            ps = [homogeneity_pvalue([s[pos] for s in plain_samples],
                                     [s[pos] for s in tree]) for pos in (1, 2)]
            ok = min(ps) > 1e-3 and stats["tree_drafts"] > 0
            rows.append(("oracle (trie)", "sampling T=1", "PASS" if ok else "FAIL",
                         f"chi-square p={ps[0]:.3g}, {ps[1]:.3g} (tokens 2, 3); "
                         f"{stats['tree_drafts']} trees"))
        except Exception as e:
            rows.append(("oracle (trie)", "sampling T=1", "FAIL",
                         f"{type(e).__name__}: {e}"))

    print(f"\nspecplug selftest  vLLM {vllm.__version__}  model {model}  dtype {args.dtype}")
    print(f"device {info.get('device')}  attention backend {info.get('backend')}  "
          f"cudagraph_mode {info.get('spec_graph_mode', info.get('graph_mode'))}  "
          f"({time.time() - t0:.0f} s)\n")
    width = max(len(r[0]) for r in rows)
    print(f"{'method':<{width}}  {'check':<16}  result  detail")
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:<16}  {r[2]:<6}  {r[3]}")
    failed = [r for r in rows if r[2] == "FAIL"]
    print(f"\n{'FAILED' if failed else 'all checks passed'}"
          f" ({len(failed)} failed, {sum(r[2] == 'SKIP' for r in rows)} skipped)")
    return 1 if failed else 0
