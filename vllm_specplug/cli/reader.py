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
   truth), node by node: :mod:`vllm_specplug.sources.tree_acceptance`.
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


def _method_setup(args) -> tuple[dict, object]:
    """The method's options with the seed template, and the seed template."""
    from vllm_specplug.sources.template import TreeTemplate

    options = json.loads(args.method_options)
    if args.method == "eagle3_tree":
        options = {"mode": "static", "template": args.seed, **options}
        return options, TreeTemplate.from_spec(args.seed, min(options.get("topk", 10), 16))
    options = {"template": args.seed, **options}
    return options, TreeTemplate.from_spec(args.seed, options.get("topk", 8))


def _calibration_prompts(args, model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_specplug import suites

    names = [n.strip() for n in args.suites.split(",") if n.strip()]
    suites.check_not_held_out(names, "calibration prompts must not be")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for name in names:
        suite = suites.tokenize(suites.load(name), tok, args.limit, 2048 - args.max_tokens)
        prompts += suite.prompts
    return prompts


def _optimize(args) -> int:
    from vllm_specplug.models.reference import reference_model_path
    from vllm_specplug.sources.tree_acceptance import measure_accepted_paths
    from vllm_specplug.sources.tree_shape import (CostCurve, choose_shape, node_acceptance,
                                                  save_template)
    from vllm_specplug.suites import SuiteUnavailable

    model = args.model or reference_model_path()
    try:
        cost = CostCurve.from_verify_cost(args.cost, args.batch)
        options, template = _method_setup(args)
        prompts = _calibration_prompts(args, model)
    except (OSError, ValueError, KeyError, SuiteUnavailable) as e:
        print(f"specplug reader optimize-tree: {e}", file=sys.stderr)
        return 1
    steps, paths = measure_accepted_paths(model, args.method, options, template, prompts,
                                          args.max_tokens)
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
