"""Shadow evaluation: the outcome every proposed node would have had.

Every proposed tree, cut or not, is compared with the tokens the target
actually produced after its root once they are known, without verifying
anything extra. A node is accepted exactly when its parent was and its
token is the next true token (greedy: the target's argmax; sampling: the
sampled token, which the lossless tree rule accepts with probability
``p(token)``, the probability that a sample equals it). The outcomes feed
``acceptance.AcceptanceModel``.
"""

from __future__ import annotations

from vllm_specplug.engine.budget.acceptance import sibling_ranks
from vllm_specplug.engine.tree import DraftTree


def shadow_outcomes(tree: DraftTree, truth) -> tuple[list[tuple], bool]:
    """Walk ``tree`` along ``truth`` (the tokens the target produced after
    the tree's root, as far as known). Returns the ``(depth, rank, accepted)``
    (plus the node's source where the tree names them) of every node whose
    parent was accepted and whose own outcome is known, and whether the walk
    is complete (nothing more can be learned later)."""
    children = tree.children()
    ranks = sibling_ranks(tree)
    sources = tree.sources
    out: list[tuple] = []
    cur, depth = -1, 0
    while children[cur + 1]:
        if depth >= len(truth):
            return out, False  # the next true token is not known yet
        nxt = None
        for c in children[cur + 1]:
            ok = tree.tokens[c] == int(truth[depth])
            out.append((depth + 1, ranks[c], ok) if sources is None
                       else (depth + 1, ranks[c], ok, sources[c]))
            if ok:
                nxt = c
        if nxt is None:
            break
        cur, depth = nxt, depth + 1
    return out, True

