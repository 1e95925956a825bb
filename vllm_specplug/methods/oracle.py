"""`oracle`: random trees around a known continuation (tests and benchmarks).

Given the target's own greedy outputs in advance (``reference_file``: JSON
list of token-id lists, prompt + output), it drafts a tree of a chosen size
that contains the true continuation down to a random depth ``a``, wrong
tokens below and beside it, laid out in a random topological order. Greedy
verification must then accept exactly ``a`` tokens, which makes the tree
engine testable without a real drafter, and gives trees of exact sizes for
the verification-cost benchmark.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Literal

from pydantic import Field

from vllm_specplug.config import MethodConfig
from vllm_specplug.engine.interface import Proposer, ProposerStats, StepRequest
from vllm_specplug.engine.tree import DraftTree, TrieBuilder


class OracleConfig(MethodConfig):
    cost_aware: bool = False
    """Off: the oracle exists to verify trees of exactly the size asked for
    (engine tests, the verification-cost benchmark)."""
    reference_file: str | None = None
    """JSON file: a list of token-id lists (prompt + greedy output). Not
    needed in ``noise`` and ``none`` modes."""
    tree_size: int = Field(default=0, ge=0)
    """Nodes per tree; 0 means num_speculative_tokens."""
    max_depth: int = Field(default=6, ge=0)
    """Largest number of true tokens placed in a tree."""
    seed: int = 0
    """Seed of the tree shapes (per request and position, so reproducible)."""
    shuffle: bool = True
    """Random topological order (exercises the KV move) instead of DFS."""
    mode: Literal["random", "trie", "noise", "none"] = "random"
    """``random``: one true path to a random depth among wrong tokens.
    ``trie``: every reference continuing the context, merged most frequent
    first (with sampled references this gives realistic sibling sets, for
    distribution tests). ``noise``: random tokens in a random tree of exactly
    ``tree_size`` nodes, whatever the context (cost of verification).
    ``none``: no tree ever: plain decoding steps through the plugin's engine
    (its runner, its CPU kernels), the baseline that isolates what the
    trees themselves cost."""
    fail_on_token: int | None = None
    """Fault injection (tests of the runner's guard): ``propose`` raises
    whenever a request whose prompt holds this token id is in the batch."""


class OracleProposer(Proposer):
    name = "oracle"
    config_cls = OracleConfig

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.refs = []
        if config.reference_file:
            with open(config.reference_file) as f:
                self.refs = [list(map(int, r)) for r in json.load(f)]
        elif config.mode not in ("noise", "none"):
            raise ValueError("oracle: reference_file is required unless mode is 'noise' or 'none'")
        self.expected_accepted = 0
        self.drafts = 0
        # A tree counts once a later step reports how much of it was
        # verified (the scheduler may keep a prefix, preemption none).
        self._pending: dict[str, tuple[DraftTree, list[int]]] = {}

    def remove_request(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def _confirm(self, req: StepRequest) -> None:
        tree, truth = self._pending.pop(req.req_id, (None, None))
        if tree is None or req.draft_kept <= 0:
            return
        self.expected_accepted += tree.truncated(req.draft_kept).follow(truth)[1]
        self.drafts += 1

    def _continuation(self, tokens: list[int]) -> list[int] | None:
        n = len(tokens)
        for ref in self.refs:
            if len(ref) > n and ref[:n] == tokens:
                return ref[n:]
        return None

    def _trie(self, tokens: list[int], size: int) -> DraftTree | None:
        n, depth = len(tokens), self.config.max_depth
        conts = Counter(tuple(r[n : n + depth]) for r in self.refs
                        if len(r) > n and r[:n] == tokens)
        if not conts:
            return None
        trie = TrieBuilder(size)
        for cont, _ in conts.most_common():
            trie.insert(cont)
        return trie.build()

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        cfg: OracleConfig = self.config
        if cfg.fail_on_token is not None and any(
                cfg.fail_on_token in r.token_ids[: r.num_prompt_tokens] for r in batch):
            raise RuntimeError(f"oracle: injected fault (fail_on_token={cfg.fail_on_token})")
        out: list[DraftTree | None] = []
        for req in batch:
            self._confirm(req)
            if req.budget <= 0 or cfg.mode == "none":
                out.append(None)
                continue
            size = min(cfg.tree_size or req.budget, req.budget)
            if cfg.mode == "noise":
                rng = random.Random(hash((cfg.seed, req.req_id, len(req.token_ids))))
                out.append(_random_tree(rng, [], size, 0, self.ctx.vocab_size, True))
                continue
            if cfg.mode == "trie":
                out.append(self._trie(req.token_ids.tolist(), req.budget))
                continue
            truth = self._continuation(req.token_ids.tolist())
            if not truth:
                out.append(None)
                continue
            rng = random.Random(hash((cfg.seed, req.req_id, len(req.token_ids))))
            tree = _random_tree(rng, truth, size, cfg.max_depth, self.ctx.vocab_size,
                                cfg.shuffle)
            if req.chain_only:
                tree = tree.first_path()
            self._pending[req.req_id] = (tree, truth)
            out.append(tree)
        return out

    def stats(self) -> ProposerStats:
        return ProposerStats(counters={"expected_accepted": self.expected_accepted,
                                       "drafts": self.drafts},
                             gauges={"live_requests": len(self._pending)})


def _random_tree(rng, truth, size, max_depth, vocab, shuffle) -> DraftTree:
    depth = rng.randint(0, min(max_depth, len(truth), size))
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    for d in range(depth):  # the true path
        tokens.append(truth[d])
        parents.append(d - 1)
        depths.append(d + 1)
    while len(tokens) < size:
        p = rng.randint(-1, len(tokens) - 1)
        d = 0 if p < 0 else depths[p]
        tok = rng.randrange(vocab)
        # A wrong token where the truth continues keeps the accepted depth
        # exactly `depth`; sibling duplicates are avoided too. Nothing goes
        # below the end of a known truth: the target's next token there is
        # unknown, and a random token could match it by chance.
        on_path = bool(truth) and p == d - 1
        if on_path and (d >= len(truth) or tok == truth[d]):
            continue
        if any(parents[i] == p and tokens[i] == tok for i in range(len(tokens))):
            continue
        tokens.append(tok)
        parents.append(p)
        depths.append(d + 1)
    # Sources let the runner's per-source counts be checked: only "truth"
    # nodes can be accepted.
    tree = DraftTree(tokens, parents,
                     sources=["truth"] * depth + ["noise"] * (len(tokens) - depth))
    return _shuffled(rng, tree) if shuffle else tree


def _shuffled(rng, tree: DraftTree) -> DraftTree:
    """A random topological order of the same tree."""
    children = tree.children()
    ready = list(children[0])
    order: list[int] = []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        ready.extend(children[node + 1])
    return tree.select(order)
