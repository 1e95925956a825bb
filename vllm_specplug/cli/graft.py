"""`specplug graft calibrate`: fit graft's checkpoint thresholds.

    specplug graft calibrate --prompts FILE --out graft_cal.json \\
        [--model DIR] [--limit 32] [--max-tokens 128] [--num-speculative-tokens 60] \\
        [--verify-cost verify_cost.json]

"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys


def register_cli(subparsers) -> None:
    from vllm_specplug.methods import graft_calibrate

    parser = subparsers.add_parser(
        "graft", help="graft method tools (threshold calibration)",
        description=__doc__ + graft_calibrate.__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="graft_command", metavar="ACTION")
    cal = sub.add_parser("calibrate", help="fit the pruning thresholds on calibration prompts")
    cal.add_argument("--prompts", required=True,
                     help="corpus file of prompts (.jsonl with 'prompt'/'turns'/'text', or "
                          ".txt), or a prompt suite such as humaneval:even")
    cal.add_argument("--out", required=True, help="calibration JSON to write")
    cal.add_argument("--model", default=None, help="target folder (default: reference model)")
    cal.add_argument("--limit", type=int, default=32, help="prompts used (default 32)")
    cal.add_argument("--max-tokens", type=int, default=128)
    cal.add_argument("--num-speculative-tokens", type=int, default=60)
    cal.add_argument("--options", default="{}",
                     help="more graft options (JSON), e.g. head, depth, topk, table_path")
    cal.add_argument("--verify-cost", default=None,
                     help="benchmarks.verify_cost JSON of this target on the serving "
                          "device (default: flat verification cost)")
    cal.add_argument("--grid", type=int, default=20, help="quantiles tried per checkpoint")
    cal.set_defaults(func=_calibrate)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _prompts(spec: str, limit: int, tokenizer) -> list[list[int]]:
    """A prompt file's first turns, or a suite's prompts (never held-out ones)."""
    from vllm_specplug import suites
    from vllm_specplug.corpus import chat_ids, iter_prompts

    if os.path.exists(spec):
        turns = [t[0] for _, t in itertools.islice(iter_prompts(spec), limit)]
        return [chat_ids(tokenizer, t) for t in turns]
    suites.check_not_held_out([spec], "calibration prompts must not be")
    return [chat_ids(tokenizer, text) for text in suites.load(spec).texts[:limit]]


def _calibrate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_specplug.methods.graft_calibrate import calibrate
    from vllm_specplug.models.reference import reference_model_path
    from vllm_specplug.suites import SuiteUnavailable

    model = args.model or reference_model_path()
    try:
        options = json.loads(args.options)
        prompts = _prompts(args.prompts, args.limit, AutoTokenizer.from_pretrained(model))
        out = calibrate(model, prompts, options=options,
                        num_speculative_tokens=args.num_speculative_tokens,
                        max_tokens=args.max_tokens, verify_cost=args.verify_cost,
                        grid=args.grid)
    except (OSError, ValueError, SuiteUnavailable) as e:
        print(f"specplug graft calibrate: {e}", file=sys.stderr)
        return 1
    out["prompts"] = args.prompts
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}: thresholds {['%.3f' % t for t in out['thresholds']]} at "
          f"checkpoints {out['checkpoints']}; {out['tokens_per_ms']:.4f} tokens/ms vs "
          f"{out['tokens_per_ms_unpruned']:.4f} unpruned over {out['steps']} steps")
    return 0
