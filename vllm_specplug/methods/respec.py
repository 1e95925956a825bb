"""`respec`: ReSpec, entropy-gated retrieval with an EAGLE-3 tree fallback (Fang et al., 2025).

Paper: "When, What, and How: Rethinking Retrieval-Enhanced Speculative
Decoding". The EAGLE-3 tree drafter (``eagle3_tree``) is its model-based
fallback (the paper's EAGLE-2).

Every step, for every request:

1. *When* (section 3.2.1, ``sources/retrieval_gate.choose_key``): from the
   target's entropies at the last ``l`` verified positions (the runner gives
   them, ``Needs.entropy``) pick the key length ``k*`` minimising
   ``H_k + lambda_e / k``; retrieve only if ``H_{k*} <= theta_entropy`` and
   the key occurred earlier in prompt + output (``sources/context_index``,
   a maintained n-gram index standing in for the paper's suffix automaton).
2. *What* (3.3, ``PositionScores``): every earlier occurrence is a
   candidate with an EMA score; those under ``theta_score`` are dropped, the
   best ``candidates`` kept and their continuations merged into the draft
   tree (sources ``"retrieval"``). After verification the one the target
   followed furthest gets ``R = L_acc / L_draft``, the others ``R = 0``.
3. Otherwise (trigger silent, no key match, every candidate filtered) the
   EAGLE-3 head drafts its dynamic tree (the paper's EAGLE-2). The head's
   state is extended from every step's verified rows either way.
4. *How* (3.4): the runner's relaxed verification of retrieval-drafted
   nodes (``engine/verify.relaxed_path``), LOSSY, only with
   ``relaxed_lossy`` (``true``, or ``"opt_in"`` for requests that send
   ``specplug_relaxed``: ``request_flags``).

Ablations: ``trigger: false`` retrieves whenever the longest key (up to
``l``) has an earlier occurrence; ``ema: false`` takes the most recent
occurrences unscored (both off: SAM-Decoding-like with 3 candidates).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field

from vllm_specplug.config import option_error
from vllm_specplug.engine.interface import (
    Needs,
    ProposerContext,
    ProposerStats,
    StepRequest,
)
from vllm_specplug.engine.tree import DraftTree, TrieBuilder
from vllm_specplug.engine.verify import RelaxedRule
from vllm_specplug.sources.eagle3_drafter import Eagle3Drafter, Eagle3DrafterConfig
from vllm_specplug.sources.context_index import ContextIndex
from vllm_specplug.sources.retrieval_gate import PositionScores, choose_key

SOURCE = "retrieval"


class RespecConfig(Eagle3DrafterConfig):
    """The EAGLE-3 head's options (``head``, ``depth``, ``topk``, ...) plus
    ReSpec's. Defaults for the reference model (SmolLM2-135M): see
    ``docs/methods/respec.md`` for how they were chosen."""

    max_key: int = Field(default=3, ge=1, le=8)
    """``l``: longest retrieval key in tokens (paper: 3)."""
    lambda_e: float = Field(default=0.5, ge=0.0)
    """Length preference of Eq. 2, ``C_k = H_k + lambda_e / k`` (nats; the
    paper leaves it open). Larger prefers longer keys."""
    theta_entropy: float = Field(default=1.5, ge=0.0)
    """Trigger threshold on ``H_{k*}`` (nats). The paper's 1.5 is for 7B
    models; this default comes from the reference model's entropy histogram
    (``benchmarks/results/respec_entropy.png``)."""
    alpha: float = Field(default=0.3, gt=0.0, le=1.0)
    """EMA update rate of Eq. 4."""
    init_score: float = Field(default=0.5, ge=0.0, le=1.0)
    """``S_0`` of a newly seen position (paper: 0.5)."""
    theta_score: float = Field(default=0.2, ge=0.0, le=1.0)
    """Positions scoring below this are not drafted. With the defaults a new
    position survives two all-rejected drafts (0.5 -> 0.35 -> 0.245) and is
    dropped after the third (0.17)."""
    candidates: int = Field(default=3, ge=1, le=16)
    """Positions merged into one retrieval tree (paper: top-3)."""
    max_occurrences: int = Field(default=1024, ge=1)
    """Most earlier occurrences of the key one retrieval scores: the most
    recent ones (a short key can occur thousands of times in a long
    context; the paper scores all)."""
    index_max_tokens: int = Field(default=32768, ge=16)
    """Most recent tokens of a request that its n-gram index holds
    (``sources/context_index``: about 0.35 KB per token at ``max_key`` 3);
    older ones are dropped, and retrieval no longer finds them."""
    tokens_per_candidate: int = Field(default=0, ge=0, le=256)
    """Continuation length per candidate; 0 shares the step's budget among
    the selected candidates (a lone candidate gets all of it)."""
    trigger: bool = True
    """Ablation switch: False ignores the entropies and retrieves whenever
    the longest key (up to ``max_key``) occurred before."""
    ema: bool = True
    """Ablation switch: False drops the scores: the most recent
    ``candidates`` occurrences, no threshold, no feedback."""
    relaxed_lossy: bool | Literal["opt_in"] = False
    """LOSSY: accept a retrieved token the target's argmax rejects when it
    is in the target's top ``relaxed_beta`` and within ``relaxed_tau_nats``
    of the top token (Eq. 6-7), at most ``relaxed_phi`` times a step, only
    if at least ``relaxed_m`` strictly accepted tokens follow it. Output is
    then NOT plain decoding's. True: every request it applies to, unless
    the request sends ``vllm_xargs: {"specplug_relaxed": false}`` (served
    losslessly); ``"opt_in"``: only requests that send
    ``{"specplug_relaxed": true}``. Greedy requests only, without logprobs
    or penalties; other requests it would apply to are refused at
    submission (HTTP 400), as is an opt-in when this is False."""
    relaxed_beta: int = Field(default=5, ge=1, le=64)
    """Eq. 6's top-k (relaxed mode)."""
    relaxed_tau_nats: float = Field(default=1.0, ge=0.0)
    """Eq. 7's tolerance ``tau`` in nats (paper recommends <= 3)."""
    relaxed_phi: int = Field(default=1, ge=1, le=16)
    """``Phi``: relaxed acceptances tried per step."""
    relaxed_m: int = Field(default=2, ge=1, le=16)
    """Strictly accepted tokens that must follow a relaxed one (paper
    recommends <= 3)."""

    def check_against(self, num_speculative_tokens: int) -> None:
        super().check_against(num_speculative_tokens)
        if self.relaxed_lossy and self.relaxed_m >= num_speculative_tokens:
            raise option_error("relaxed_m", f"must be < num_speculative_tokens="
                               f"{num_speculative_tokens}", self.relaxed_m)


class _Req:
    """One request's retrieval state."""

    def __init__(self, cfg: RespecConfig) -> None:
        self.index = ContextIndex(cfg.max_key, cfg.index_max_tokens)
        self.scores = PositionScores(cfg.alpha, cfg.init_score)
        self.entropy = np.full(256, np.nan)
        # the previous step's draft: (kind, history length, candidate paths)
        self.last: tuple[str, int, list[tuple[int, list[int], list[int]]]] | None = None

    def record_entropy(self, r: StepRequest) -> None:
        if r.entropy is None or not r.sampled:
            return
        ent = r.entropy.float().cpu().numpy()
        last = len(r.token_ids) - 2  # the last row produced the newest token
        if last + 1 > len(self.entropy):
            grown = np.full(max(last + 1, 2 * len(self.entropy)), np.nan)
            grown[: len(self.entropy)] = self.entropy
            self.entropy = grown
        lo = last - len(ent) + 1
        self.entropy[max(lo, 0) : last + 1] = ent[max(-lo, 0):]

    def recent_entropies(self, t: int, n: int) -> np.ndarray:
        """The known entropies of positions ``t-n .. t-1`` (the run ending at
        ``t-1``)."""
        win = self.entropy[max(0, t - n) : t]
        known = ~np.isnan(win)
        if not known.all():
            win = win[np.flatnonzero(~known)[-1] + 1 :]
        return win


class RespecProposer(Eagle3Drafter):
    name = "respec"
    config_cls = RespecConfig

    def __init__(self, config: RespecConfig, ctx: ProposerContext) -> None:
        super().__init__(config, ctx)  # the EAGLE-3 head and its runtime
        self.reqs: dict[str, _Req] = {}
        self.c = {k: 0 for k in (
            "steps", "triggered", "no_match", "filtered", "retrieved", "fallback",
            "retrieval_verified", "retrieval_accepted", "model_verified",
            "model_accepted")}

    def needs(self) -> Needs:
        cfg: RespecConfig = self.config
        rule = None
        if cfg.relaxed_lossy:
            rule = RelaxedRule(cfg.relaxed_beta, cfg.relaxed_tau_nats, cfg.relaxed_phi,
                               cfg.relaxed_m, (SOURCE,))
        return Needs(aux_layers=self.aux_layers, entropy=cfg.trigger,
                     prompt_entropy_rows=cfg.max_key + 1, relaxed=rule,
                     rows_on_host=True)  # the trigger reads entropies on the host

    def add_request(self, req_id: str) -> None:
        super().add_request(req_id)
        self.reqs[req_id] = _Req(self.config)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.reqs.pop(req_id, None)

    def propose(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        cfg: RespecConfig = self.config
        retrieved: list[DraftTree | None] = [None] * len(batch)
        for i in self.deadline.order(batch):
            r = batch[i]
            st = self.reqs.get(r.req_id)
            if st is None:
                st = self.reqs[r.req_id] = _Req(cfg)
            st.record_entropy(r)
            self._feedback(st, r)
            if r.sampled and r.budget > 0:
                # only retrieval reads the index: a request the gate keeps
                # from drafting catches up when it next drafts, or never
                st.index.sync(r.token_ids)
                self.c["steps"] += 1
                # past the step's time budget: no retrieval, the head drafts
                if self.deadline.allows(r.req_id):
                    retrieved[i] = self._retrieve(st, r)
        # the head extends every request's state; it drafts where retrieval did not
        drafted = super().propose(batch, [t is None for t in retrieved])
        out = []
        for r, rt, mt in zip(batch, retrieved, drafted):
            st = self.reqs[r.req_id]
            if rt is not None:
                out.append(rt)
            else:
                if r.sampled and r.budget > 0:
                    self.c["fallback"] += 1
                st.last = ("model", len(r.token_ids), []) if mt is not None else None
                out.append(mt)
        return out

    # ------------------------------------------------------------ retrieval
    def _retrieve(self, st: _Req, r: StepRequest) -> DraftTree | None:
        cfg: RespecConfig = self.config
        toks = r.token_ids
        if cfg.trigger:
            ent = st.recent_entropies(len(toks) - 1, cfg.max_key)
            key = choose_key(ent, cfg.max_key, cfg.lambda_e, cfg.theta_entropy)
            if not key.fire:
                return None
            self.c["triggered"] += 1
            ends = st.index.ends(toks[len(toks) - key.length :], limit=cfg.max_occurrences)
        else:  # ablation: the longest key that occurred before
            self.c["triggered"] += 1
            ends = []
            for k in range(min(cfg.max_key, len(toks)), 0, -1):
                ends = st.index.ends(toks[len(toks) - k :], limit=cfg.max_occurrences)
                if ends:
                    break
        if not ends:
            self.c["no_match"] += 1
            return None
        if cfg.ema:
            selected = st.scores.select(ends, cfg.theta_score, cfg.candidates)
        else:
            selected = [int(p) for p in ends[::-1][: cfg.candidates]]
        if not selected:
            self.c["filtered"] += 1
            return None
        budget = r.budget
        per = cfg.tokens_per_candidate or math.ceil(budget / len(selected))
        trie = TrieBuilder(budget)
        conts = []
        for p in selected:
            cont = st.index.continuation(p, per)
            conts.append(cont)
            trie.insert(cont, source=SOURCE)
        tree = trie.build()
        if not len(tree):
            return None
        # per node: the best EMA score of the candidates through it, decayed
        # by depth (a cost-aware budget cuts by it)
        score = {p: st.scores.scores.get(p, cfg.init_score) for p in selected}
        paths, node_score = [], [float("-inf")] * len(tree)
        children = tree.children()
        for p, cont in zip(selected, conts):
            node, path = -1, []
            for tok in cont:
                nxt = next((c for c in children[node + 1] if tree.tokens[c] == tok), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            for d, n in enumerate(path):
                s = math.log(max(score[p], 1e-3)) + (d + 1) * math.log(0.9)
                node_score[n] = max(node_score[n], s)
            paths.append((p, cont[: len(path)], path))
        tree = DraftTree(tree.tokens, tree.parents, node_score, tree.sources)
        self.c["retrieved"] += 1
        st.last = ("retrieval", len(toks), paths)
        return tree

    def _feedback(self, st: _Req, r: StepRequest) -> None:
        """Learn from the previous draft, now that the history says what the
        target accepted (Eq. 4-5; tokens after the drafted history are the
        accepted path plus one bonus token)."""
        last, st.last = st.last, None
        if last is None or r.draft_kept <= 0 or len(r.token_ids) <= last[1]:
            return
        kind, base, paths = last
        new = [int(t) for t in r.token_ids[base:]]
        accepted = len(new) - 1
        self.c[f"{kind}_verified"] += 1
        self.c[f"{kind}_accepted"] += accepted
        if kind != "retrieval" or not self.config.ema:
            return
        best, winner, drafted = 0, None, 0
        for p, cont, path in paths:
            n_draft = sum(1 for n in path if n < r.draft_kept)
            match = 0
            while match < min(n_draft, accepted) and cont[match] == new[match]:
                match += 1
            if match > best:
                best, winner, drafted = match, p, n_draft
        st.scores.feedback([p for p, _, _ in paths], winner, best, drafted)

    # ---------------------------------------------------------------- stats
    def stats(self) -> ProposerStats:
        s = super().stats()
        s.counters.update(self.c)
        s.counters["deadline_skips"] = self.deadline.skipped
        s.gauges["live_requests"] = len(self.reqs)
        return s

    @classmethod
    def rates(cls, c: dict[str, int]) -> dict[str, float]:
        steps = max(1, c.get("steps", 0))
        return {
            "trigger_rate": c.get("triggered", 0) / steps,
            "retrieval_rate": c.get("retrieved", 0) / steps,
            "fallback_rate": c.get("fallback", 0) / steps,
            "retrieval_mean_accepted": c.get("retrieval_accepted", 0)
            / max(1, c.get("retrieval_verified", 0)),
            "model_mean_accepted": c.get("model_accepted", 0)
            / max(1, c.get("model_verified", 0)),
        }
