"""Which nodes of a draft-tree template the target accepts (the profile
``specplug reader optimize-tree`` prunes, :mod:`vllm_specplug.sources.tree_shape`).

The target runs greedily with a method drafting the template; every drafted
tree is compared, node by node, with the tokens the target then produced
(greedy output is the truth, whatever tree was verified).
"""

from __future__ import annotations

import os


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


def measure_accepted_paths(model: str, method: str, options: dict, template,
                           prompts: list[list[int]],
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
