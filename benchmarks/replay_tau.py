"""tau of specplug methods by replay, without a serving engine.

For when engines are too slow to start (issue 20 ran on a 2-core machine
shared by a dozen engines: plain decoding ran at 0.1-0.5 tokens/s there).
tau (tokens per target pass) of a greedy request depends only on what the
method drafts and on the target's greedy output, so it can be replayed:

1. ``--stage target``: the reference model (Hugging Face, float32) answers
   each prompt greedily (``--max-tokens``, EOS ignored; batched with left
   padding), then one unpadded forward pass over prompt + answer gives what
   the runner would capture at every position: the output of the decoder
   layers the methods ask for and the top-k next tokens with their
   probabilities. Saved to ``--cache``.
2. ``--stage replay``: each method's real proposer (``registry``) is driven
   the way the runner drives it: a prefill step with the prompt rows, then
   one step per target pass with the root + accepted rows, ``budget`` =
   ``num_speculative_tokens``, requests in flight ``--batch`` at a time
   (continuous batching: a finished request's slot takes the next one).
   Each tree is cut by ``normalize_tree`` and verified against the known
   answer (longest accepted path + the bonus token).

What it does not model: the cost-aware budget (off here, as in every
issue-20 comparison), vLLM's scheduler caps (none at these sizes), and the
target's top-k at *rejected* tree nodes (``Needs.tree_topk``): ``recycle``
learns only from prompt and accepted rows here, so it is slightly
underestimated. Losslessness is not measured here (no engine): the engine
tests and ``benchmarks.run`` do that.

    python -m benchmarks.replay_tau --stage target --cache /tmp/target.pt
    python -m benchmarks.replay_tau --stage replay --cache /tmp/target.pt \\
        --methods pld,adapld,adapld@paper,recycle --method-options @benchmarks/configs/issue20.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.suites import load, tokenize

K = 8


def target_stage(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.models.reference import reference_model_path

    path = reference_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = [int(x) for x in args.layers.split(",")]
    out = {"model": path, "max_tokens": args.max_tokens, "layers": layers, "suites": {}}
    for name in args.suites.split(","):
        prompts = tokenize(load(name), tok, args.limit, args.max_prompt_len).prompts
        t0 = time.time()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id or 0)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or 0)
        rows = []
        for i, p in enumerate(prompts):
            answer = gen[i, width:].tolist()
            seq = torch.tensor([p + answer])
            with torch.no_grad():
                o = model(seq, output_hidden_states=True)
            probs = torch.softmax(o.logits[0].float(), dim=-1)
            tp, ti = probs.topk(K, dim=-1)
            # hidden_states[i] is the output of decoder layer i-1
            rows.append({"prompt": p, "answer": answer, "topk_ids": ti, "topk_probs": tp,
                         "hidden": {L: o.hidden_states[L + 1][0].clone() for L in layers}})
        out["suites"][name] = rows
        print(f"{name}: {len(rows)} prompts in {time.time() - t0:.0f} s", flush=True)
        torch.save(out, args.cache)
    out["embed_tokens"] = model.get_input_embeddings().weight.detach().clone()
    out["num_hidden_layers"] = model.config.num_hidden_layers
    out["hidden_size"] = model.config.hidden_size
    out["vocab_size"] = model.config.vocab_size
    torch.save(out, args.cache)


class _Req:
    """One request's replay state."""

    def __init__(self, rid: str, row: dict, max_tokens: int) -> None:
        self.rid, self.row = rid, row
        self.prompt, self.answer = row["prompt"], row["answer"][:max_tokens]
        self.g = 1  # answer tokens known (the prefill pass sampled the first)
        self.passes = 1
        self.accepted = 0
        self.verified_pos, self.n_rows = 0, len(self.prompt)  # prefill rows
        self.prefill = True
        self.kept = 0

    def done(self) -> bool:
        return self.g >= len(self.answer)

    def step(self, needs, budget: int):
        from vllm_specplug.engine.interface import StepRequest

        toks = np.array(self.prompt + self.answer[: self.g], dtype=np.int64)
        lo, hi = self.verified_pos, self.verified_pos + self.n_rows
        r = self.row
        ids = probs = None
        if needs.topk:
            ids, probs = r["topk_ids"][lo:hi, : needs.topk], r["topk_probs"][lo:hi, : needs.topk]
        layer = r["hidden"][needs.hidden_layer][lo:hi] if needs.hidden_layer is not None else None
        node_tokens = node_topk = None
        if needs.tree_topk and ids is not None:
            node_tokens, node_topk = torch.as_tensor(toks[lo:hi]), ids
        return StepRequest(
            req_id=self.rid, token_ids=toks, num_prompt_tokens=len(self.prompt), sampled=True,
            verified_pos=lo, layer_hidden=layer, topk_ids=ids, topk_probs=probs,
            node_tokens=node_tokens, node_topk_ids=node_topk, draft_kept=self.kept,
            budget=min(budget, len(self.answer) - self.g))

    def verify(self, tree) -> None:
        truth = self.answer[self.g :]
        m = tree.follow(truth)[1] if tree is not None and len(tree) else 0
        self.kept = len(tree) if tree is not None else 0
        self.verified_pos = len(self.prompt) + self.g - 1  # the root
        self.n_rows = m + 1
        new = min(m + 1, len(self.answer) - self.g)
        self.accepted += new - 1
        self.g += new
        self.passes += 1


def replay(method: str, opts: dict, target: dict, suites: list[str], n_spec: int,
           batch: int, max_tokens: int, limit: int | None = None) -> dict:
    from vllm_specplug.engine.interface import ProposerContext
    from vllm_specplug.engine.tree import normalize_tree
    from vllm_specplug.registry import get

    cls = get(method.split("@")[0])
    cfg = cls.config_cls(**opts)
    cfg.check_against(n_spec)
    ctx = ProposerContext(
        vocab_size=target["vocab_size"], hidden_size=target["hidden_size"],
        num_speculative_tokens=n_spec, max_model_len=4096, device=torch.device("cpu"),
        dtype=torch.float32, model_path=target["model"], tokenizer_path=target["model"],
        embed_tokens=target["embed_tokens"], num_hidden_layers=target["num_hidden_layers"])
    prop = cls(cfg, ctx)  # one proposer for the whole run, as one engine
    needs = prop.needs()
    res = {}
    for name in suites:
        pending = [_Req(f"{name}-{i}", r, max_tokens)
                   for i, r in enumerate(target["suites"][name][:limit])]
        live: list[_Req] = []
        finished: list[_Req] = []
        t0 = time.time()
        while pending or live:
            while pending and len(live) < batch:
                req = pending.pop(0)
                prop.add_request(req.rid)
                live.append(req)
            steps = [r.step(needs, n_spec) for r in live]
            trees = prop.propose(steps)
            for r, s, t in zip(live, steps, trees):
                t = None if t is None or not len(t) else normalize_tree(t, s.budget)
                r.verify(t if t is not None and len(t) else None)
            for r in [r for r in live if r.done()]:
                prop.remove_request(r.rid)
                live.remove(r)
                finished.append(r)
        taus = [r.g / (r.g - r.accepted) for r in finished]
        res[name] = {"tau": float(np.mean(taus)), "tau_per_request": taus,
                     "generated": sum(r.g for r in finished),
                     "accepted": sum(r.accepted for r in finished),
                     "seconds": round(time.time() - t0, 1)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=("target", "replay"), required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--suites", default="specbench:summarization,specbench:rag,"
                    "specbench:math_reasoning,specbench:qa,specbench:translation,"
                    "specbench:mt_bench,humaneval:odd")
    ap.add_argument("--limit", type=int, default=8, help="prompts per suite (replay: the first ones)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=1024 - 128)
    ap.add_argument("--layers", default="10", help="decoder layers to capture (adapld: 30//3)")
    ap.add_argument("--methods", default="pld,adapld,adapld@paper,recycle")
    ap.add_argument("--method-options", default="{}")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.stage == "target":
        target_stage(args)
        return
    target = torch.load(args.cache, weights_only=False)
    opts = args.method_options
    opts = json.load(open(opts[1:])) if opts.startswith("@") else json.loads(opts)
    suites = [s for s in args.suites.split(",") if s in target["suites"]]
    doc = {"how": "benchmarks.replay_tau", "max_tokens": args.max_tokens,
           "num_speculative_tokens": args.num_speculative_tokens, "model": target["model"],
           "prompts_per_suite": {s: len(target["suites"][s][: args.limit]) for s in suites},
           "method_options": opts, "results": {}}
    for b in map(int, args.batch.split(",")):
        for m in args.methods.split(","):
            r = replay(m, opts.get(m, {}), target, suites, args.num_speculative_tokens,
                       b, args.max_tokens, args.limit)
            doc["results"][f"{m}/b{b}"] = r
            print(f"b{b} {m:14s} " + " ".join(f"{s.split(':')[-1]}={v['tau']:.2f}"
                                               for s, v in r.items()), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
