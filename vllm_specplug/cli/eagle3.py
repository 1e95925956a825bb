"""`specplug eagle3 ...`: build EAGLE-3 draft heads for vLLM's built-in ``eagle3``.

    specplug eagle3 generate-data --target DIR --out DATA [--sources ...]
    specplug eagle3 train --data DATA --out HEAD [--draft-vocab-size N] ...

The head in HEAD loads unchanged with
``speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": K}``.
Both commands resume where they stopped when run again with the same
arguments.  Works for Llama-family and Qwen2 targets (any target whose vLLM
class supports EAGLE-3 and whose HF folder has ``model.embed_tokens``).

Heavy imports (torch, vLLM, transformers) happen inside the commands.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["register_cli"]


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "eagle3", help="generate data for and train EAGLE-3 draft heads",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="eagle3_command", metavar="SUBCOMMAND")

    g = sub.add_parser(
        "generate-data",
        help="the target's responses (vLLM) + its aux hidden states (transformers) in shards",
        description=("Stage 1: render prompts with the target's chat template and let the "
                     "target answer them with vLLM (multi-turn prompts turn by turn). Stage "
                     "2: run the target in float32 with transformers over prompt+response "
                     "and store the residual streams of the aux layers (vLLM's default "
                     "EAGLE-3 layers) and the final hidden state, fp16 safetensors shards. "
                     "Resumable: finished chunks/shards are skipped."))
    g.add_argument("--target", required=True, help="target model folder (Hugging Face format)")
    g.add_argument("--out", required=True, help="data folder (created; rerun to resume)")
    g.add_argument("--sources", default="spec_bench,gsm8k:200,humaneval,synthetic:200",
                   help="comma list of SOURCE[:COUNT]: spec_bench, gsm8k, humaneval, "
                        "synthetic, sharegpt (conversations from index 10,000 on), "
                        "file:PATH (.jsonl turns/prompt/text or .txt) "
                        "(default %(default)s)")
    g.add_argument("--spec-bench", help="Spec-Bench question.jsonl (default: shared copy)")
    g.add_argument("--num-prompts", type=int, help="cap on the number of prompts")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="skip turns whose rendered prompt is longer (default 1024)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--shard-size", type=int, default=64, help="prompts per shard")
    g.add_argument("--aux-layers", help="comma list of target layers to fuse "
                                        "(default: vLLM's (2, N//2, N-3))")
    g.add_argument("--gen-dtype", default="float32", help="vLLM dtype for generation")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, help="torch threads for the hidden-state pass")
    g.add_argument("--extend", action="store_true",
                   help="add the prompts of --sources the folder does not hold yet (by id); "
                        "finished shards are kept")
    g.set_defaults(func=_cmd_generate)

    t = sub.add_parser(
        "train", help="train a head on a data folder (EAGLE-3 training-time test)",
        description=("Train the fc + one decoder layer + norm + lm_head of an EAGLE-3 head "
                     "with the training-time test over --ttt-steps draft steps. Writes "
                     "config.json + model.safetensors (vLLM's eagle3 format), curves.json/"
                     "curves.png and a resumable checkpoint; rerun to resume."))
    t.add_argument("--data", required=True, help="data folder from generate-data")
    t.add_argument("--out", required=True, help="head folder")
    t.add_argument("--target", help="target folder (default: the one recorded in the data)")
    t.add_argument("--draft-vocab-size", type=int, default=0,
                   help="top-N response tokens as draft vocabulary (0 = full, default)")
    t.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps (default 7)")
    t.add_argument("--step-weight", type=float, default=0.8,
                   help="loss weight of step k is this ** k (default 0.8)")
    t.add_argument("--loss", choices=["kl", "ce"], default="kl",
                   help="kl: against the target distribution (default); ce: data tokens")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--max-updates", type=int, help="overrides --epochs")
    t.add_argument("--batch-size", type=int, default=8, help="samples per update")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip", type=float, default=0.5)
    t.add_argument("--max-len", type=int, default=2048, help="truncate samples (tokens)")
    t.add_argument("--intermediate-size", type=int, help="MLP width (default: the target's)")
    t.add_argument("--eval-samples", type=int, default=16)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--save-every", type=int, default=50, help="updates between checkpoints")
    t.add_argument("--log-every", type=int, default=5)
    t.add_argument("--head-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    t.add_argument("--checkpoint-dir", help="resumable state (default OUT/checkpoint)")
    t.add_argument("--max-minutes", type=float, help="stop (and save) after this long")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, help="torch threads")
    t.add_argument("--init-from", metavar="HEAD_DIR",
                   help="start from this saved head (weights and draft vocabulary), e.g. "
                        "to go on training a shipped head on a bigger data folder")
    t.set_defaults(func=_cmd_train)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _cmd_generate(args) -> int:
    from vllm_specplug.eagle3.data import generate_data

    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
    man = generate_data(
        args.target, args.out, sources=args.sources, spec_bench=args.spec_bench,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature,
        top_p=args.top_p, shard_size=args.shard_size, aux_layers=aux, seed=args.seed,
        gen_dtype=args.gen_dtype, threads=args.threads, extend=args.extend)
    print(json.dumps({k: v for k, v in man.items() if k != "shards"}, indent=1))
    return 0


def _cmd_train(args) -> int:
    import dataclasses

    from vllm_specplug.eagle3.train import TrainConfig, train

    opts = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
            if hasattr(args, f.name)}
    res = train(args.data, args.out, TrainConfig(**opts))
    print(json.dumps({"update": res["update"], "total": res["total"], "eval": res["eval"]},
                     indent=1))
    return 0

