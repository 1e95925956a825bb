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

Device work is batched so that a step costs one device->host copy, not one
per tree node: ``child_probs`` gathers ``p(c)`` of every child of every
internal node of every sampled tree in one indexing op and draws one uniform
per internal node from each request's own generator (``ChildDraws``, still
on the device, so the runner reads them back in the same copy as the argmax
rows); ``choose_paths`` then walks the trees on the host, and
``greedy_accepted`` says on the host what vLLM's greedy rejection rule will
accept of each chosen path (``greedy_output``: and what it will output, so
an all-greedy step need not run it). ``q`` is kept sparse (children ids and
probabilities) until ``draft_probs_tensor`` writes vLLM's dense
``[path tokens, vocab]`` draft-probability input with one scatter.
``child_draws_chunked`` makes the sampled rows' probabilities a chunk of
whole requests at a time, so no ``[all tree rows, vocab]`` tensor exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.engine.transfer import to_device
from vllm_specplug.engine.tree import DraftTree


@dataclass
class Paths:
    paths: list[list[int]]
    """Per request, node indices (into its draft list) along the chosen path."""
    q_rows: list[tuple[list[int], list[float]] | int]
    """Per path node, in order: the draft distribution as (token ids,
    probabilities), or a token id meaning one-hot (chains and greedy
    requests); a negative id (vLLM's padding) means no draft (zero row)."""


@dataclass
class ChildProbs:
    """Host copies of what a sampled walk needs, per request index."""

    p: dict[int, list[list[float]]]
    """request -> per parent (-1, then node order, only parents with
    children): ``p`` of each child in ``children()`` order."""
    u: dict[int, list[float]]
    """request -> one uniform draw per parent with children, same order."""


def request_chunks(sizes: Sequence[int], max_rows: int) -> list[list[int]]:
    """Positions of ``sizes`` grouped in order so that each group's total
    is at most ``max_rows`` (a single size above it makes its own group):
    whole requests per chunk, as vLLM's per-request expansion needs."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if groups and total + n <= max_rows:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


def _parents(tree: DraftTree) -> list[tuple[int, list[int]]]:
    children = tree.children()
    return [(p - 1, ch) for p, ch in enumerate(children) if ch]


def _child_cells(tree: DraftTree, toks: list[int], base: int
                 ) -> tuple[list[int], list[int], list[tuple[int, list[int]]]]:
    """(probability rows, token columns) of every child of every internal
    node of one tree whose row after the root is ``base``, and its parents."""
    parents = _parents(tree)
    rows, cols = [], []
    for p, ch in parents:
        rows.extend([base + p + 1] * len(ch))
        cols.extend(toks[c] for c in ch)
    return rows, cols, parents


def _gather(probs: torch.Tensor, rows: list[int], cols: list[int]) -> torch.Tensor:
    idx = to_device(np.asarray([rows, cols], dtype=np.int64), torch.long, probs.device)
    return probs[idx[0], idx[1]].double()


def _uniforms(sampled, parents, device, generators) -> list[torch.Tensor]:
    """One uniform per parent with children, from each request's own
    generator, drawn in ``sampled`` order."""
    return [torch.rand(len(parents[i]), device=device, generator=generators.get(i),
                       dtype=torch.float64) for i in sampled]


@dataclass
class ChildDraws:
    """``ChildProbs`` before the device->host copy: every gathered ``p(c)``
    then every uniform, as one flat float64 tensor (None: no sampled tree
    has a child), and how to split it."""

    values: torch.Tensor | None
    sampled: list[int]
    parents: dict[int, list[tuple[int, list[int]]]]

    def on_host(self, flat: list[float] | None = None) -> ChildProbs:
        """The split host copy; ``flat``: ``values`` already read back (with
        other tensors, in one copy), else read here."""
        if self.values is None:
            return ChildProbs({}, {})
        if flat is None:
            flat = self.values.cpu().tolist()
        return _split(flat, self.sampled, self.parents)


def _split(flat: list[float], sampled, parents) -> ChildProbs:
    out_p, out_u, k = {}, {}, 0
    for i in sampled:
        per = []
        for _, ch in parents[i]:
            per.append(flat[k : k + len(ch)])
            k += len(ch)
        out_p[i] = per
    for i in sampled:
        n = len(parents[i])
        out_u[i] = flat[k : k + n]
        k += n
    return ChildProbs(out_p, out_u)


def child_probs(
    trees: dict[int, DraftTree],
    drafts: list[list[int]],
    sampled: list[int],
    probs: torch.Tensor,
    prob_base: dict[int, int],
    generators: dict[int, torch.Generator],
) -> ChildProbs:
    """Gather ``p(child)`` for every internal node of the ``sampled`` trees.

    ``probs[prob_base[i] + 1 + j]`` is request i's distribution after node j
    (``+0``: after the root). One gather, one uniform draw per request (its
    own generator when seeded) and a single device->host copy.
    """
    rows, cols, parents = [], [], {}
    for i in sampled:
        r, c, parents[i] = _child_cells(trees[i], drafts[i], prob_base[i])
        rows += r
        cols += c
    uniforms = _uniforms(sampled, parents, probs.device, generators)
    if not rows:
        return ChildProbs({}, {})
    values = torch.cat([_gather(probs, rows, cols), *uniforms])
    return ChildDraws(values, sampled, parents).on_host()


def child_draws_chunked(
    trees: dict[int, DraftTree],
    drafts: list[list[int]],
    sampled: list[int],
    row_counts: dict[int, int],
    probs_of: Callable[[list[int]], torch.Tensor],
    generators: dict[int, torch.Generator],
    max_rows: int,
) -> ChildDraws:
    """``child_probs``' draws, left on the device (``ChildDraws``), with the
    probabilities made a chunk of whole requests at a time:
    ``probs_of(requests)`` gives those requests' rows (``row_counts[i]``
    each, in order), at most ``max_rows`` rows a chunk unless one request
    has more. Only the gathered children outlive a chunk; the same draws,
    the same result."""
    parents, gathered, device = {}, [], None
    for group in request_chunks([row_counts[i] for i in sampled], max_rows):
        reqs = [sampled[g] for g in group]
        rows, cols, base = [], [], 0
        for i in reqs:
            r, c, parents[i] = _child_cells(trees[i], drafts[i], base)
            rows += r
            cols += c
            base += row_counts[i]
        if rows:
            probs = probs_of(reqs)
            device = probs.device
            gathered.append(_gather(probs, rows, cols))
            del probs
    if not gathered:
        return ChildDraws(None, sampled, parents)
    uniforms = _uniforms(sampled, parents, device, generators)
    return ChildDraws(torch.cat([*gathered, *uniforms]), sampled, parents)


def choose_paths(
    trees: dict[int, DraftTree],
    drafts: list[list[int]],
    row_base,
    greedy: set[int],
    argmax: list[int] | None,
    sampled: ChildProbs | None,
) -> Paths:
    """``drafts[i]``: request i's draft tokens; its logits rows are
    ``row_base[i] + 0`` (root) and ``row_base[i] + 1 + j`` (after node j).
    Requests without an entry in ``trees`` are chains. Greedy tree requests
    need ``argmax`` (per logits row), sampled ones ``sampled``
    (``child_probs``). Pure host code."""
    paths: list[list[int]] = []
    q_rows: list = []
    for i, toks in enumerate(drafts):
        tree = trees.get(i)
        if tree is None:
            paths.append(list(range(len(toks))))
            q_rows.extend(toks)
            continue
        children = tree.children()
        if i not in greedy:
            slot = {p: k for k, (p, _) in enumerate(_parents(tree))}
        path: list[int] = []
        cur = -1
        while children[cur + 1]:
            ch = children[cur + 1]
            if i in greedy:
                row = int(row_base[i]) + cur + 1
                nxt = next((c for c in ch if toks[c] == argmax[row]), None)
                if nxt is None:
                    break
                q_rows.append(toks[nxt])
            else:
                k = slot[cur]
                pc = sampled.p[i][k]
                mass = sum(pc)
                if mass <= 0.0:
                    break
                # Inverse CDF of p(c)/P(C) with this node's uniform draw.
                target, acc, pick = sampled.u[i][k] * mass, 0.0, len(ch) - 1
                for j, pj in enumerate(pc):
                    acc += pj
                    if target < acc:
                        pick = j
                        break
                nxt = ch[pick]
                q_rows.append(([toks[c] for c in ch], [pj / mass for pj in pc]))
            path.append(nxt)
            cur = nxt
        paths.append(path)
    return Paths(paths, q_rows)


def greedy_accepted(paths: list[list[int]], drafts: list[list[int]], row_base,
                    argmax: list[int]) -> list[int]:
    """Per request, how many tokens of its chosen path vLLM's greedy
    rejection rule accepts: the leading ones equal to the argmax of the row
    before them (the root's row, then the row after each accepted node).
    A greedy tree path is chosen that way, so all of it; a chain stops at
    its first miss. Exact where the rejection sampler's argmax is this one:
    no logits processor, penalty or bad word changes the rows (the caller
    checks). Pure host code."""
    out = []
    for i, path in enumerate(paths):
        row, n = int(row_base[i]), 0
        for j in path:
            if drafts[i][j] != argmax[row]:
                break
            n += 1
            row = int(row_base[i]) + 1 + j
        out.append(n)
    return out


def greedy_output(paths: list[list[int]], drafts: list[list[int]], row_base,
                  argmax: list[int]) -> tuple[np.ndarray, list[int]]:
    """What vLLM's greedy rejection sampler outputs for the chosen paths,
    read from the argmax rows on the host: per request the accepted draft
    tokens (``greedy_accepted``), then the argmax of the row after the last
    one (the correction where a draft missed, the bonus where none did),
    padded with -1 to ``[requests, longest path + 1]`` int32, its layout.
    Returns that array and the accepted counts. Exact where nothing changes
    the rows the sampler reads, bonus rows included (the caller checks).
    Pure host code."""
    accepted = greedy_accepted(paths, drafts, row_base, argmax)
    width = max((len(p) for p in paths), default=0) + 1
    out = np.full((len(paths), width), -1, dtype=np.int32)
    for i, path in enumerate(paths):
        n = accepted[i]
        last_row = int(row_base[i]) + (1 + path[n - 1] if n else 0)
        out[i, :n] = [drafts[i][j] for j in path[:n]]
        out[i, n] = argmax[last_row]
    return out, accepted


def draft_probs_tensor(q_rows, vocab: int, device) -> torch.Tensor:
    """vLLM's ``draft_probs [len(q_rows), vocab]``, written with one scatter.
    Negative token ids (vLLM's ``-1`` padding of fully cached prompts) get a
    zero row: no draft, so a rejection resamples from ``p`` itself. Not
    chunked (vLLM's rejection sampler takes it whole): its size is part of
    the profile run's reservation (``runner/memory.step_items``)."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for r, q in enumerate(q_rows):
        if isinstance(q, tuple):
            ids, ps = q
            rows.extend([r] * len(ids))
            cols.extend(ids)
            vals.extend(ps)
        elif q >= 0:
            rows.append(r)
            cols.append(q)
            vals.append(1.0)
    out = torch.zeros(len(q_rows), vocab, device=device)
    if rows:
        idx = to_device(np.asarray([rows, cols], dtype=np.int64), torch.long, device)
        out[idx[0], idx[1]] = to_device(vals, torch.float32, device)
    return out


@dataclass(frozen=True)
class RelaxedRule:
    """ReSpec's relaxed verification with look-ahead tolerance (section 3.4).

    LOSSY: the output is no longer plain decoding's. For greedy requests
    only, and only for draft nodes whose ``DraftTree.sources`` name is in
    ``sources``. A node the argmax rejects is accepted anyway when its token
    is in the target's top ``beta`` there (Eq. 6), at most ``tau`` nats below
    the top token (Eq. 7), and at least ``m`` strictly accepted nodes follow
    it in the tree; at most ``phi`` such attempts per step, and the walk ends
    at the first attempt that fails (no node qualifies)."""

    beta: int
    tau: float
    phi: int
    m: int
    sources: tuple[str, ...]


def relaxed_path(tree: DraftTree, toks: list[int], rule: RelaxedRule,
                 top_ids: list[list[int]], top_logp: list[list[float]]
                 ) -> tuple[list[int], list[int]]:
    """The greedy path through ``tree`` under ``rule``, and which of its
    nodes were relaxed (accepted against the argmax). ``top_ids[r]`` /
    ``top_logp[r]``: the target's top-``beta`` tokens and log-probabilities,
    best first, at row ``r`` (0: after the root, ``1 + j``: after node j).
    Pure host code."""
    children = tree.children()
    src = tree.sources or [""] * len(toks)

    def strict_child(node: int) -> int | None:
        top = top_ids[node + 1][0]
        return next((c for c in children[node + 1] if toks[c] == top), None)

    def strict_run(node: int) -> int:
        n = 0
        while (node := strict_child(node)) is not None:
            n += 1
        return n

    path: list[int] = []
    relaxed: list[int] = []
    cur, attempts = -1, 0
    while children[cur + 1]:
        nxt = strict_child(cur)
        if nxt is None:
            if attempts >= rule.phi:
                break
            attempts += 1
            row_ids, row_lp = top_ids[cur + 1], top_logp[cur + 1]
            for c in children[cur + 1]:
                if src[c] not in rule.sources or toks[c] not in row_ids[: rule.beta]:
                    continue
                rank = row_ids.index(toks[c])
                if row_lp[0] - row_lp[rank] <= rule.tau and strict_run(c) >= rule.m:
                    nxt = c
                    relaxed.append(c)
                    break
            if nxt is None:
                break
        path.append(nxt)
        cur = nxt
    return path, relaxed
