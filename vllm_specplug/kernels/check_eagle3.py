"""The EAGLE-3 head runtime's tree expansion on CUDA against CPU (part of
``python -m vllm_specplug.kernels.check``; torch and numpy only).

Random weights at two shapes, the reference head's (SmolLM2-135M: 576
wide) and a 4096-wide one (an 8B-class target), float32 on both devices.
Several requests of different context lengths share one batched draft, so
the padded layout of the expansion is exercised. The trees must have the
same tokens and parents on both devices and scores within ``SCORE_ATOL``;
the lm_head is drawn wide enough that the top-k's gaps dwarf float error,
so a mismatch is a bug, not a tie.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

SCORE_ATOL = 2e-3
SHAPES = {
    "reference_576": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152,
                          num_hidden_layers=30, draft_vocab=12288),
    "wide_4096": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=32000,
                      num_hidden_layers=32, draft_vocab=8192),
}


def random_head(shape: dict, seed: int):
    """An ``Eagle3Draft`` with random weights at ``shape`` (CPU, float32)."""
    from vllm_specplug.eagle3.model import Eagle3Draft, build_head_config, vocab_mapping

    target = {k: v for k, v in shape.items() if k != "draft_vocab"}
    target.update(rope_theta=100000.0, rms_norm_eps=1e-5, model_type="llama")
    cfg = build_head_config(target, (2, 15, 27), shape["draft_vocab"], dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden = shape["vocab_size"], shape["hidden_size"]
    embed = torch.randn(vocab, hidden, generator=gen) * 0.02
    used = torch.randperm(vocab, generator=gen)[:shape["draft_vocab"]].tolist()
    d2t, t2d = vocab_mapping(used, vocab)
    torch.manual_seed(seed)
    head = Eagle3Draft(cfg, embed, d2t, t2d)
    with torch.no_grad():  # spread the logits: top-k gaps far above float error
        head.lm_head.weight.normal_(0.0, 4.0 / hidden ** 0.5, generator=gen)
    return head.eval()


def draft_trees(head, contexts: list[int], seed: int, depth: int, topk: int, budget: int):
    from vllm_specplug.eagle3.runtime import Eagle3Runtime

    rt = Eagle3Runtime(head)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    width = head.fc.in_features
    ids = []
    for i, n in enumerate(contexts):
        rid = f"r{i}"
        tokens = rng.integers(0, head.cfg["vocab_size"], n + 1)
        aux = torch.randn(n, width, generator=gen)
        rt.add(rid)
        rt.extend([(rid, 0, tokens, aux)])
        ids.append(rid)
    return rt.draft(ids, [budget] * len(ids), depth=depth, topk=topk)


def compare_trees(cpu, gpu) -> dict:
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        if a is None or b is None:
            if a is not b:
                return {"ok": False, "request": i, "why": "a tree on one device only"}
            continue
        if a.tokens != b.tokens or a.parents != b.parents:
            first = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
                         min(len(a), len(b)))
            return {"ok": False, "request": i, "why": f"trees differ from node {first}",
                    "nodes": [len(a), len(b)]}
        err = float(np.max(np.abs(np.subtract(a.scores, b.scores)))) if len(a) else 0.0
        if err > SCORE_ATOL:
            return {"ok": False, "request": i, "why": f"scores differ by {err:.2e}"}
    return {"ok": True, "nodes": [0 if t is None else len(t) for t in cpu]}


def check_eagle3(quick: bool, device: str | None = None) -> dict:
    """``device``: where the expansion runs against CPU (default: CUDA,
    skipped without one)."""
    if device is None:
        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device", "checks": []}
        device = "cuda"
    checks = []
    for name, shape in SHAPES.items():
        if quick and name != "reference_576":
            continue
        head = random_head(shape, seed=len(name))
        gpu_head = copy.deepcopy(head).to(device)
        contexts = [7, 50, 301]
        args = dict(contexts=contexts, seed=11, depth=6, topk=8, budget=48)
        with torch.no_grad():
            cpu_trees = draft_trees(head, **args)
            gpu_trees = draft_trees(gpu_head, **args)
        checks.append({"kernel": "eagle3_tree_expansion", "shape": name, "device": device,
                       "contexts": contexts, **compare_trees(cpu_trees, gpu_trees)})
        del gpu_head
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"checks": checks}
