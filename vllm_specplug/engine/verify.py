"""Lossless tree verification, reduced to chain verification.

For each request a path is chosen through its draft tree by the target's own
distribution ``p`` at each node:

- greedy: follow the child whose token is the argmax, stop when none is;
- sampling: with children ``C`` carrying mass ``P(C) = sum p(c)``, pick child
  ``c`` with probability ``p(c)/P(C)`` and record the draft distribution
  ``q = p restricted to C, normalised``.

The path is then verified as a chain by the ordinary rejection rule
(accept ``c`` with ``min(1, p(c)/q(c)) = P(C)``, else draw from
``(p - q)+`` which is ``p`` with the children removed). Descending into ``c``
therefore has probability ``q(c) P(C) = p(c)``, and a rejection emits ``y``
with probability ``p(y)`` for every ``y`` outside ``C``: the target's
distribution, exactly as SGLang's/EAGLE's sibling walk gives. Chains keep
vLLM's own behaviour (one-hot ``q``, the whole chain verified).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.engine.tree import DraftTree


@dataclass
class Paths:
    paths: list[list[int]]
    """Per request, node indices (into its draft list) along the chosen path."""
    q_rows: list[torch.Tensor | int]
    """Per path node, in order: the draft distribution, or a token id meaning
    one-hot (chains and greedy requests)."""


def choose_paths(
    trees: dict[int, DraftTree],
    drafts: list[list[int]],
    row_base: np.ndarray,
    greedy: set[int],
    argmax: list[int] | None,
    probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> Paths:
    """``drafts[i]``: request i's draft tokens; its logits rows are
    ``row_base[i] + 0`` (root) and ``row_base[i] + 1 + j`` (after node j).
    Requests without an entry in ``trees`` are chains."""
    paths: list[list[int]] = []
    q_rows: list[torch.Tensor | int] = []
    for i, toks in enumerate(drafts):
        tree = trees.get(i)
        if tree is None:
            paths.append(list(range(len(toks))))
            q_rows.extend(toks)
            continue
        children = tree.children()
        path: list[int] = []
        cur = -1
        while children[cur + 1]:
            ch = children[cur + 1]
            row = int(row_base[i]) + cur + 1
            if i in greedy:
                nxt = next((c for c in ch if toks[c] == argmax[row]), None)
                if nxt is None:
                    break
                q_rows.append(toks[nxt])
            else:
                ids = torch.tensor([toks[c] for c in ch], device=probs.device)
                pc = probs[row, ids].double()
                mass = float(pc.sum())
                if mass <= 0.0:
                    break
                pick = int(torch.multinomial(pc / mass, 1, generator=generators.get(i)))
                nxt = ch[pick]
                q = torch.zeros(probs.shape[-1], device=probs.device)
                q[ids] = (pc / mass).float()
                q_rows.append(q)
            path.append(nxt)
            cur = nxt
        paths.append(path)
    return Paths(paths, q_rows)


def draft_probs_tensor(q_rows, vocab: int, device) -> torch.Tensor:
    out = torch.zeros(len(q_rows), vocab, device=device)
    for r, q in enumerate(q_rows):
        if isinstance(q, torch.Tensor):
            out[r] = q
        else:
            out[r, q] = 1.0
    return out
