"""Measure how often each successor-rank path of an adjacency table is right,
to shape ``recycle``'s small-budget templates (``sources/template.py``,
``MEASURED``).

Replay, not a serving run: the reference model (float32, Hugging Face
transformers on CPU) answers held-out prompts greedily; one forward pass
over prompt + answer gives its top-k after every position. The replay then
walks the answer as a ``recycle`` request at batch 1 would see it: the
table row of a token is the target's top-k at that token's most recent
earlier position (prompt positions learned first, as at prefill; a table
shared across the prompts in order, as the default shared table). At every
answer position the rank path the target's next tokens follow in the table
(rank of token t+1 among the row of token t, then of t+2 in the row of t+1,
...) is counted; ``freq[path]`` = share of positions whose accepted path
starts with ``path``. Rejected tree nodes, which the engine also learns
from, are not simulated (they only add rows).

Prompts: Spec-Bench rows 8-9 of each of the six categories and the first 4
of ``humaneval:even`` -- none of them is among the prompts the benchmarks
measure (the first 8 per category, ``humaneval:odd``).

    python -m benchmarks.studies.rank_acceptance --out benchmarks/results/rank_acceptance.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from benchmarks import result_file
from benchmarks.suites import load, tokenize

CATEGORIES = ("summarization", "rag", "math_reasoning", "qa", "translation", "mt_bench")


def prompts(tokenizer) -> list[list[int]]:
    out: list[list[int]] = []
    for cat in CATEGORIES:
        s = tokenize(load(f"specbench:{cat}"), tokenizer, 10, 1024)
        out += s.prompts[8:10]
    out += tokenize(load("humaneval:even"), tokenizer, 4, 1024).prompts
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--sizes", default="8,16")
    ap.add_argument("--out", default="benchmarks/results/rank_acceptance.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.models.reference import reference_model_path

    path = str(reference_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    torch.set_num_threads(1)
    counts: Counter = Counter()
    positions = 0
    table: dict[int, list[int]] = {}
    for ids in prompts(tok):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id)[0]
            topk = model(gen[None]).logits[0].topk(args.k, dim=-1).indices.tolist()
        seq = gen.tolist()
        p = len(ids)
        for i in range(p - 1):  # prefill: the prompt rows
            table[seq[i]] = topk[i]
        for t in range(p - 1, len(seq) - 1):
            # seq[t] was just sampled (the first answer token at t = p, but
            # the prompt's last token also starts a draft at t = p - 1)
            cur, path = seq[t], ()
            for d in range(1, args.depth + 1):
                if t + d >= len(seq) or cur not in table:
                    break
                row = table[cur]
                nxt = seq[t + d]
                if nxt not in row:
                    break
                path = path + (row.index(nxt),)
                counts[path] += 1
                cur = nxt
            positions += 1
            table[seq[t]] = topk[t]
    freq = {",".join(map(str, k)): v / positions for k, v in counts.items()}
    templates = {}
    for n in map(int, args.sizes.split(",")):
        # f(child) <= f(parent), so the n most frequent paths are
        # prefix-closed; ties: shorter, then lexicographic ranks.
        best = sorted(counts, key=lambda k: (-counts[k], len(k), k))[:n]
        best.sort(key=lambda k: (-counts[k], len(k), k))
        templates[n] = [list(k) for k in best]
    depth1 = [counts.get((r,), 0) / positions for r in range(args.k)]
    res = {"model": path, "positions": positions, "k": args.k,
           "depth1_rank_acceptance": depth1,
           "expected_accepted": {n: sum(counts[tuple(p)] for p in ps) / positions
                                 for n, ps in templates.items()},
           "templates": templates,
           "freq": dict(sorted(freq.items(), key=lambda kv: -kv[1])[:64])}
    result_file.write(res, args.out)
    print(json.dumps({k: v for k, v in res.items() if k != "freq"}, indent=1))


if __name__ == "__main__":
    main()
