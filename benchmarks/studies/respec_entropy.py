"""The reference model's next-token entropies, to choose ReSpec's
``theta_entropy`` (a 135M model's entropy scale is not a 7B model's).

Greedy generation with transformers (float32) on Spec-Bench first turns of
summarization, rag, qa and translation (the *last* prompts of each category,
so not the ones ``benchmarks.run --limit`` measures; mt_bench and
math_reasoning are not looked at). Per generated position it records the
entropy of the distribution that produced the token, and per step the
trigger's ``H_{k*}`` (``retrieval_gate.choose_key``) together with whether
the most recent earlier occurrence of the key ``k*`` continues with the
token greedy decoding actually produced (a retrieval that would pay).

    python -m benchmarks.studies.respec_entropy --out benchmarks/results/respec_entropy
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.figures import save_png

CATEGORIES = ("summarization", "rag", "qa", "translation")


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.corpus import chat_ids
    from vllm_specplug.eagle3.prompts import spec_bench_path
    from vllm_specplug.models.reference import reference_model_path
    from vllm_specplug.sources.retrieval_gate import choose_key

    ap = argparse.ArgumentParser()
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lambda-e", type=float, default=0.5)
    ap.add_argument("--out", default="benchmarks/results/respec_entropy")
    args = ap.parse_args()

    torch.set_num_threads(1)
    path = reference_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with open(spec_bench_path(), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    data = {}
    for cat in CATEGORIES:
        picked = [r for r in rows if r["category"] == cat][-args.per_category:]
        ents, steps = [], []
        for r in picked:
            ids = chat_ids(tok, r["turns"][0])[-768:]
            n_prompt = len(ids)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens,
                                     do_sample=False, output_scores=True,
                                     return_dict_in_generate=True)
            seq = out.sequences[0].tolist()
            h = [float(torch.special.entr(torch.softmax(s[0].float(), -1)).sum())
                 for s in out.scores]
            ents.extend(h)
            # per step t (newest token seq[t]), the trigger over the entropies
            # of the distributions that produced seq[t-k+1..t]
            for t in range(n_prompt + 2, len(seq) - 1):
                known = h[: t - n_prompt + 1]
                c = choose_key(known[-3:], 3, args.lambda_e, float("inf"))
                key = seq[t - c.length + 1 : t + 1]
                hit = None
                for p in range(t - 1, c.length - 2, -1):
                    if seq[p - c.length + 1 : p + 1] == key:
                        hit = seq[p + 1] == seq[t + 1]
                        break
                if hit is not None:
                    steps.append((c.entropy, bool(hit)))
        data[cat] = {"entropies": ents, "steps": steps}
        print(cat, len(ents), "tokens; median entropy", float(np.median(ents)))
    with open(args.out + ".json", "w") as f:
        json.dump({"lambda_e": args.lambda_e, "categories": data}, f)
    plot(data, args.out + ".png")


def plot(data: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bins = np.linspace(0, 8, 33)
    for cat, d in data.items():
        a.hist(d["entropies"], bins=bins, histtype="step", density=True, label=cat)
    a.set_xlabel("entropy of the target's next-token distribution (nats)")
    a.set_ylabel("density")
    a.set_title("SmolLM2-135M-Instruct, greedy outputs")
    a.legend()
    edges = np.linspace(0, 4, 17)
    allsteps = [s for d in data.values() for s in d["steps"]]
    for cat, d in [*data.items(), ("all", {"steps": allsteps})]:
        if not d["steps"]:
            continue
        h = np.array([s[0] for s in d["steps"]])
        ok = np.array([s[1] for s in d["steps"]], dtype=float)
        idx = np.clip(np.digitize(h, edges) - 1, 0, len(edges) - 2)
        rate = [ok[idx == i].mean() if (idx == i).sum() >= 5 else np.nan
                for i in range(len(edges) - 1)]
        b.plot((edges[:-1] + edges[1:]) / 2, rate, marker="o", label=cat,
               lw=2.5 if cat == "all" else 1)
    b.set_xlabel("trigger's H_k* (nats, lambda_e=0.5)")
    b.set_ylabel("retrieved first token correct")
    b.set_title("steps with an earlier key occurrence")
    b.legend()
    fig.tight_layout()
    save_png(fig, png, dpi=110)


if __name__ == "__main__":
    main()
