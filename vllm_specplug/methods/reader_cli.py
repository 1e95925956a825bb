"""`specplug reader optimize-tree`: a static draft-tree shape for this
model, batch size and machine (READER, Appendix E).

    specplug reader optimize-tree --cost benchmarks/results/verify_cost.json \\
        --batch 1 --out ~/.cache/vllm_specplug/eagle3-b1.json

1. Runs the target (in-process vLLM, float32, greedy, cost-aware budget
   off) with ``--method`` (``eagle3_tree`` in static mode, or ``recycle``)
   drafting the over-sized ``--seed`` template on calibration prompts that
   are never evaluated (default ``humaneval:even,specbench:qa``).
2. Measures each template node's acceptance: every drafted tree is
   compared with the tokens the target then produced (greedy output is the
   truth), node by node.
3. Prunes the lowest-acceptance leaves and picks the size with the most
   expected tokens per ms of the ``--cost`` curve (``benchmarks.verify_cost``
   JSON at ``--batch``): :mod:`vllm_specplug.sources.tree_shape`.
4. Writes the template file, loadable as ``template`` by ``eagle3_tree`` /
   ``reader`` (``mode: static``) and ``recycle``.

The cost curve decides the size: a curve measured on a CPU gives a CPU
shape; measure ``verify_cost`` on the serving GPU for a GPU shape.
"""

from __future__ import annotations

import json
import os
import sys


def register_cli(sub) -> None:
    p = sub.add_parser("reader", help="READER tools (tree-shape optimisation)")
    rsub = p.add_subparsers(dest="reader_command", metavar="COMMAND")
    o = rsub.add_parser("optimize-tree", help=__doc__.splitlines()[0],
                        description=__doc__,
                        formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    o.add_argument("--cost", required=True, help="benchmarks.verify_cost JSON")
    o.add_argument("--batch", type=int, default=1, help="batch size of the cost curve")
    o.add_argument("--out", required=True, help="template file to write (.json)")
    o.add_argument("--method", default="eagle3_tree", choices=("eagle3_tree", "recycle"))
    o.add_argument("--seed", default="default",
                   help="over-sized seed template (preset or level counts)")
    o.add_argument("--method-options", default="{}", help="JSON, e.g. '{\"topk\": 10}'")
    o.add_argument("--suites", default="humaneval:even,specbench:qa")
    o.add_argument("--limit", type=int, default=8, help="prompts per suite")
    o.add_argument("--max-tokens", type=int, default=64)
    o.add_argument("--model", help="target folder (default: the reference model)")
    o.add_argument("--extra-nodes", type=int, default=0,
                   help="rows verified beside the template (reader: d_search + d_deep)")
    o.add_argument("--draft-ms-per-node", type=float, default=0.0)
    o.add_argument("--profile", help="also write the measured acceptance here (JSON)")
    o.set_defaults(func=_optimize)


def tree_rank_paths(tree, template) -> list[tuple[int, ...]]:
    """Each node's template rank path: siblings are laid out best first, so
    a node's index among its siblings picks its parent's template children
    in rank order."""
    kids: dict[tuple[int, ...], list[int]] = {}
    for path in template.rank_paths():
        kids.setdefault(path[:-1], []).append(path[-1])
    for v in kids.values():
        v.sort()
    out: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for p, _ in zip(tree.parents, tree.tokens):
        parent = out[p] if p >= 0 else ()
        i = seen.get(p, 0)
        seen[p] = i + 1
        ranks = kids.get(parent, [])
        out.append(parent + ((ranks[i] if i < len(ranks) else 10**6),))
    return out


def measure(model: str, method: str, options: dict, template, prompts: list[list[int]],
            max_tokens: int) -> tuple[int, list[tuple[int, ...]]]:
    """Steps drafted and, per step, the accepted template rank path."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_specplug import registry
    from vllm_specplug.config import TOOL_KV_CACHE_BYTES

    cls = registry.get(method)
    records: list[tuple[str, int, object]] = []
    orig = cls.propose

    def propose(self, batch):
        trees = orig(self, batch)
        for r, t in zip(batch, trees):
            if t is not None and len(t):
                records.append((r.req_id, len(r.token_ids), t))
        return trees

    cls.propose = propose
    try:
        spec = {"method": method, "num_speculative_tokens": len(template),
                "cost_aware": False, **options}
        llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0,
                  enforce_eager=True, speculative_config=spec,
                  kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True), use_tqdm=False)
    finally:
        cls.propose = orig
    full = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    accepted = []
    for rid, n, tree in records:
        # vLLM's internal id is "<request_id>-<8 random chars>"
        truth = full.get(rid.rsplit("-", 1)[0])
        if truth is None or n >= len(truth):
            continue
        node, depth = tree.follow(truth[n:])
        paths = tree_rank_paths(tree, template)
        accepted.append(paths[node] if node >= 0 else ())
    return len(accepted), accepted


def _optimize(args) -> int:
    from transformers import AutoTokenizer

    from benchmarks import suites
    from vllm_specplug.models.reference import reference_model_path
    from vllm_specplug.sources.template import TreeTemplate
    from vllm_specplug.sources.tree_shape import (CostCurve, choose_shape, node_acceptance,
                                                  save_template)

    try:
        cost = CostCurve.from_verify_cost(args.cost, args.batch)
        options = json.loads(args.method_options)
    except (OSError, ValueError, KeyError) as e:
        print(f"specplug reader optimize-tree: {e}", file=sys.stderr)
        return 1
    model = args.model or reference_model_path()
    if args.method == "eagle3_tree":
        options = {"mode": "static", "template": args.seed, **options}
        template = TreeTemplate.from_spec(args.seed, min(options.get("topk", 10), 16))
    else:
        options = {"template": args.seed, **options}
        template = TreeTemplate.from_spec(args.seed, options.get("topk", 8))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for name in args.suites.split(","):
        suite = suites.load(name.strip())
        prompts += suites.tokenize(suite, tok, args.limit, 2048 - args.max_tokens).prompts
    steps, paths = measure(model, args.method, options, template, prompts, args.max_tokens)
    alpha = node_acceptance(template, steps, paths)
    choice = choose_shape(template, alpha, cost, extra_nodes=args.extra_nodes,
                          draft_ms_per_node=args.draft_ms_per_node)
    meta = {"method": args.method, "seed": args.seed, "seed_nodes": len(template),
            "calibration": args.suites, "prompts": len(prompts), "steps": steps,
            "cost": os.path.abspath(args.cost), "batch_size": args.batch,
            "expected_tokens": choice.expected_tokens, "step_ms": choice.step_ms,
            "model": os.path.basename(os.path.normpath(model))}
    save_template(args.out, choice.template, meta)
    if args.profile:
        with open(args.profile, "w", encoding="utf-8") as f:
            json.dump({"rank_paths": [list(p) for p in template.rank_paths()],
                       "alpha": alpha.tolist(), "curve": choice.curve, "meta": meta}, f)
    print(json.dumps({"out": args.out, "size": choice.size,
                      "level_sizes": choice.template.level_sizes(), **meta}))
    return 0
