"""Tree verification, the ``verify`` part of a step.

``_prepare_inputs`` gives tree nodes their RoPE positions (``root_pos +
depth``; slots stay linear, as vLLM computed them) and the attention wrapper
each tree's ancestor mask. ``_sample`` chooses a path through each tree by
the target's own distribution (greedy: follow the argmax child; sampling:
follow child ``c`` with probability ``p(c)/P(children)``), then vLLM's own
rejection sampler verifies that path as a chain with draft distribution
``q = p restricted to the children``. Accept probability is then
``P(children)`` and the residual is ``p`` without the children: exactly the
lossless tree rule, and vLLM's logprobs, stop handling and bookkeeping stay
untouched. The accepted path's K/V is then moved to consecutive slots
(the ``KV move``).

What the host needs from the device comes back in one copy a step
(``engine/transfer.read_back``): the argmax rows and the sampled walks'
draws together, before the paths are chosen. The draft tokens are vLLM's
host copy, and where every request is greedy and nothing changes the rows
vLLM's verifier reads, how much of each path it accepts is known on the
host (``engine/verify.greedy_accepted``) and its output is not read back;
otherwise it is, once. Where, besides, no logprobs are asked and no logits
processor could move a bonus row, the host makes vLLM's whole output
(``engine/verify.greedy_output``) and its sampler does not run: on a
small CPU its fixed cost is a visible share of a step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.structured_output.utils import strip_speculative_padding

from vllm_specplug.engine.transfer import read_back, to_device
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.engine.verify import (
    choose_paths,
    draft_probs_tensor,
    greedy_accepted,
    greedy_output,
    relaxed_path,
)
from vllm_specplug.request_flags import wants_relaxed
from vllm_specplug.runner.logit_rows import log_softmax_topk, sampled_child_probs
from vllm_specplug.runner.step_state import StepState, root_rows
from vllm_specplug.runner.tree_attention import LayerMoves, TreeRow, TreeStep, move_accepted_kv


def path_chain_metadata(paths, drafts, row_base, device):
    """vLLM chain metadata for the chosen paths.

    Returns the metadata, the logits rows to gather (``[root, path...]`` per
    request, the layout vLLM's rejection sampler expects of a chain) and the
    path tokens.
    """
    gather: list[int] = []
    tokens: list[list[int]] = []
    for i, path in enumerate(paths):
        b = int(row_base[i])
        gather.append(b)
        gather.extend(b + 1 + j for j in path)
        tokens.append([drafts[i][j] for j in path])
    lens = np.asarray([len(p) for p in paths], dtype=np.int64)
    cu_s = np.cumsum(lens + 1)
    starts = cu_s - (lens + 1)
    target = np.concatenate([s + np.arange(n) for s, n in zip(starts, lens)])

    def t(x):
        return to_device(np.asarray(x, dtype=np.int32), torch.int32, device)

    meta = SpecDecodeMetadata(
        draft_token_ids=t(sum(tokens, [])),
        num_draft_tokens=lens.tolist(),
        cu_num_draft_tokens=t(np.cumsum(lens)),
        cu_num_sampled_tokens=t(cu_s),
        target_logits_indices=t(target),
        bonus_logits_indices=t(starts + lens),
        logits_indices=t(np.arange(len(gather))),
    )
    return meta, to_device(gather, torch.long, device), tokens


# vLLM's own logits processors that can move an argmax: each acts only for a
# request with a setting that ``_chain_only`` refuses (min_tokens,
# logit_bias), so with none of those they leave every row as it is.
_VLLM_ARGMAX_MOVERS = (LogitBiasLogitsProcessor, MinTokensLogitsProcessor)


def _no_draft_at_all(meta: SpecDecodeMetadata | None, sampling_metadata) -> bool:
    """A spec-decode step in which no request has a draft token, and no
    request asks for logprobs (their layout differs between vLLM's two
    samplers)."""
    return (meta is not None and meta.max_spec_len == 0
            and sampling_metadata.max_num_logprobs is None)


def _drafts_per_request(meta: SpecDecodeMetadata,
                        host: list[list[int]] | None = None) -> list[list[int]]:
    """Each request's draft tokens, in batch order: ``host`` (the scheduler's
    own lists, see ``StepState.drafts``) where it has the metadata's
    lengths, else read from the device."""
    if host is not None and [len(d) for d in host] == list(meta.num_draft_tokens):
        return host
    flat = meta.draft_token_ids.tolist()
    cu = np.concatenate([[0], np.cumsum(meta.num_draft_tokens)])
    return [flat[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def _num_real(tokens) -> int:
    # vLLM pads a new request whose prompt is fully cached with a draft of
    # -1s (uniform step shapes); that is no draft, whatever vLLM's counters
    # say.
    return len(strip_speculative_padding(list(tokens)))


def _chain_only(sp) -> bool:
    """Sampling that vLLM's chain verifier handles with per-path context
    (penalties, bad words, logits processors, structured output...)."""
    if sp is None:
        return True
    return bool(
        sp.presence_penalty or sp.frequency_penalty
        or (sp.repetition_penalty not in (None, 1.0))
        or sp.bad_words or sp.logit_bias or sp.allowed_token_ids
        or sp.min_tokens or getattr(sp, "structured_outputs", None)
        or getattr(sp, "logits_processors", None)
    )


def _path_inputs(logits, need_argmax: bool, draws):
    """What choosing the paths reads from the device, in one copy: the
    argmax of every logits row (when a greedy tree needs it) and the
    sampled walks' draws (``engine/verify.ChildDraws``)."""
    values = None if draws is None else draws.values
    top = logits.argmax(dim=-1) if need_argmax else None
    top, values = read_back(top, values)
    argmax = None if top is None else top.tolist()
    walks = None if draws is None else draws.on_host(
        None if values is None else values.tolist())
    return argmax, walks


class VerifyMixin:
    """Tree positions and masks before the forward, tree verification and
    the KV move after it (see module doc)."""

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        n = self.input_batch.num_reqs
        qsl = self.query_start_loc.np[: n + 1]
        drafts = np.zeros(n, dtype=np.int64)
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid, toks in spec.items():
            drafts[self.input_batch.req_id_to_index[rid]] = len(toks)
        roots = root_rows(qsl, drafts)
        req_ids = self.input_batch.req_ids
        host_drafts = [list(spec.get(req_ids[i], ())) for i in range(n)]
        trees: dict[int, DraftTree] = {}
        rows: list[TreeRow] = []
        node_rows, node_pos = [], []  # tree nodes' RoPE positions, set in one copy
        for rid, toks in spec.items():
            tree = self._sp_requests.trees.get(rid)
            m = len(toks)
            if tree is None or m == 0 or tree.tokens[:m] != list(toks):
                continue  # no tree, or a stale one: vLLM verifies a chain
            tree = tree.truncated(m)
            if tree.is_chain() and not self._sp_relaxable(tree):
                continue
            i = self.input_batch.req_id_to_index[rid]
            s = int(roots[i])
            # The root's position: tokens computed before this step plus any
            # rows scheduled ahead of it.
            c = int(self.input_batch.num_computed_tokens_cpu[i]) + s - int(qsl[i])
            node_rows.append(np.arange(s + 1, s + 1 + m))
            node_pos.append(tree.depths() + c)
            mask = torch.from_numpy(tree.ancestor_mask()[1:])
            if self.device.type != "cuda":
                mask = mask.to(self.device)
            rows.append(TreeRow(s, m, c, i, mask, chain_prefix=tree.chain_prefix()))
            trees[i] = tree
        if node_rows:
            dev = self.positions.device
            self.positions[to_device(np.concatenate(node_rows), torch.long, dev)] = to_device(
                np.concatenate(node_pos), self.positions.dtype, dev)
        self._sp_state = StepState(trees=trees, root_row=roots,
                                   attention=TreeStep(rows, query_start_loc=qsl.copy())
                                   if rows else None,
                                   drafts=host_drafts)
        return out

    # ------------------------------------------------- verification (trees)
    def _sample(self, logits, spec_decode_metadata):
        state = self._sp_state
        if state is None:  # a dummy/profile run: no _prepare_inputs
            state = self._sp_state = StepState({}, np.zeros(0, np.int64), None)
        if spec_decode_metadata is not None:
            state.logit_rows = np.asarray(spec_decode_metadata.num_draft_tokens,
                                          dtype=np.int64) + 1
        else:
            state.logit_rows = np.ones(self.input_batch.num_reqs, dtype=np.int64)
        state.logit_base = np.cumsum(state.logit_rows) - state.logit_rows
        try:
            if _no_draft_at_all(spec_decode_metadata, self.input_batch.sampling_metadata):
                # vLLM runs its rejection sampler whenever speculation is
                # configured, drafts or not (~4% of a batch-8 CPU step):
                # with no draft in the step the plain sampler gives the same
                # [requests, 1] tokens (the bonus rows are all the logits)
                out = super()._sample(logits, None)
                n_reqs = len(spec_decode_metadata.num_draft_tokens)
                for i in range(n_reqs):
                    state.accepted_rows[i] = [0]
                self._sp_stats.record_chains([0] * n_reqs, [1] * n_reqs)
            elif spec_decode_metadata is None or not state.trees:
                if spec_decode_metadata is None:
                    out = super()._sample(logits, None)
                else:
                    out = self._sp_sample_chains(logits, spec_decode_metadata, state)
            else:
                out = self._sp_sample_trees(logits, spec_decode_metadata, state)
        finally:
            state.attention = None
        if self._sp_budget.will_draft:
            # Top-k and entropies only serve drafts (a method's tables and
            # triggers learn from them): a step whose gate is closed drafts
            # nothing and skips them, so a gated step costs what a plain one
            # does: `graft`'s top-k of every row and `respec`'s entropies
            # are a few percent of a batch-8 CPU step, most of what a gated
            # step of theirs would pay over plain decoding. What they would
            # have taught is lost:
            # tables and entropy windows learn again from the next step that
            # drafts (an exploring one, or the gate open).
            self._sp_topk(logits, state)
            self._sp_entropy(logits, state)
        return out

    def _sp_sample_chains(self, logits, meta: SpecDecodeMetadata, state: StepState):
        """A step whose drafts are all chains: vLLM's verifier, or its
        output read on the host where that is exact (``_sp_greedy_on_host``)."""
        drafts = _drafts_per_request(meta, state.drafts)
        if self._sp_greedy_on_host():
            argmax, _ = _path_inputs(logits, True, None)
            paths = [list(range(len(d))) for d in drafts]
            out, accepted = self._sp_host_output(paths, drafts, state.logit_base, argmax,
                                                 logits.device)
            emitted = [n + 1 for n in accepted]
        else:
            out = super()._sample(logits, meta)
            emitted = (out.sampled_token_ids != -1).sum(-1).tolist()
        for i, n in enumerate(emitted):
            state.accepted_rows[i] = list(range(max(n, 1)))
        self._sp_stats.record_chains([_num_real(d) for d in drafts], emitted)
        return out

    def _sp_host_output(self, paths, drafts, base, argmax, device):
        """vLLM's greedy verdict on ``paths``, made on the host
        (``engine/verify.greedy_output``): the output and accepted counts."""
        tokens, accepted = greedy_output(paths, drafts, base, argmax)
        return SamplerOutput(to_device(tokens, torch.int32, device), None), accepted

    def _sp_greedy_on_host(self) -> bool:
        """Whether vLLM's verifier would output exactly what the host reads
        from the argmax rows, so that its sampler need not run (a visible
        share of a small CPU step): every request greedy, no logprobs asked,
        the rows it reads raw (``_sp_verifier_reads_raw_rows``) and no logits
        processor the server added, which could move a bonus row's argmax
        (vLLM's own act only through settings ``_chain_only`` refuses)."""
        sm = self.input_batch.sampling_metadata
        return (sm.all_greedy and sm.max_num_logprobs is None
                and not getattr(sm, "logprob_token_ids", None)
                and all(isinstance(p, _VLLM_ARGMAX_MOVERS)
                        for p in sm.logitsprocs.non_argmax_invariant)
                and self._sp_verifier_reads_raw_rows())

    def _sp_sample_trees(self, logits, meta: SpecDecodeMetadata, state: StepState):
        sm = self.input_batch.sampling_metadata
        n_draft = meta.num_draft_tokens
        drafts = _drafts_per_request(meta, state.drafts)
        base = state.logit_base
        temps = self.input_batch.temperature_cpu[: len(n_draft)]
        greedy = {i for i, t in enumerate(temps) if sm.all_greedy or t == 0.0}
        sampled = sorted(i for i in state.trees if i not in greedy)
        draws = None
        if sampled:
            draws = sampled_child_probs(logits, state.trees, drafts, sampled, n_draft,
                                        base, sm)
        argmax, walks = _path_inputs(logits, len(sampled) < len(state.trees), draws)
        chosen = choose_paths(state.trees, drafts, base, greedy, argmax, walks)
        relaxed = {}
        if self._sp_needs.relaxed is not None:
            relaxed = self._sp_relax(state, drafts, greedy, chosen, logits)
        if argmax is not None and not relaxed and self._sp_greedy_on_host():
            out, accepted = self._sp_host_output(chosen.paths, drafts, base, argmax,
                                                 logits.device)
            self._sp_finish_trees(state, chosen.paths, drafts, accepted)
            return out
        path_meta, gather, path_tokens = path_chain_metadata(
            chosen.paths, drafts, base, logits.device
        )
        draft_probs = None
        if sampled:
            draft_probs = draft_probs_tensor(chosen.q_rows, logits.shape[-1], logits.device)
        if sm.spec_token_ids is not None:
            sm = dataclasses.replace(sm, spec_token_ids=path_tokens)
        path_logits = logits[gather]
        if relaxed:
            # LOSSY (opt-in): make each relaxed token the argmax of the row
            # that verifies it, so vLLM's greedy verifier accepts it (these
            # requests were checked to return no logprobs)
            starts = np.cumsum([len(p) + 1 for p in chosen.paths])
            for i, ks in relaxed.items():
                off = int(starts[i]) - len(chosen.paths[i]) - 1
                for k in ks:
                    tok = path_tokens[i][k]
                    row = path_logits[off + k]
                    row[tok] = row.max() + 1.0
                    self._sp_stats.relaxed_tokens += 1
        if any(chosen.paths):
            out = self.rejection_sampler(path_meta, draft_probs, path_logits, sm)
        else:
            # every walk stopped at its root: vLLM's rejection sampler would
            # get no target row (its top-k fails on an empty tensor); the
            # plain sampler on the root rows gives the same [requests, 1]
            # tokens and logprobs
            out = super()._sample(path_logits, None)
        if (argmax is not None and not relaxed and len(greedy) == len(drafts)
                and self._sp_verifier_reads_raw_rows()):
            accepted = greedy_accepted(chosen.paths, drafts, base, argmax)
        else:
            accepted = ((out.sampled_token_ids != -1).sum(-1) - 1).clamp(min=0).tolist()
        self._sp_finish_trees(state, chosen.paths, drafts, accepted)
        return out

    def _sp_finish_trees(self, state: StepState, paths, drafts, accepted) -> None:
        """The accepted paths' K/V moved, their rows and counts recorded."""
        self._sp_move_kv(state, paths, accepted)
        for i, path in enumerate(paths):
            state.accepted_rows[i] = [0] + [1 + j for j in path[: accepted[i]]]
        self._sp_stats.record_trees([_num_real(d) for d in drafts], accepted,
                                    state.trees)

    def _sp_verifier_reads_raw_rows(self) -> bool:
        """vLLM's greedy verifier takes the argmax of the very rows the paths
        were chosen by: no request in the batch has a penalty, bad words,
        allowed tokens, a minimum length or a logits processor
        (``_chain_only``; vLLM applies those to the rows it verifies), no
        thinking budget is tracked, and the rejection sampler is not in
        its synthetic-acceptance test mode."""
        if getattr(self.rejection_sampler, "synthetic_mode", False):
            return False
        holder = getattr(self.input_batch.sampling_metadata,
                         "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            return False
        for rid in self.input_batch.req_ids:
            req = self.requests.get(rid)
            if req is None or _chain_only(req.sampling_params):
                return False
        return True

    def _sp_relaxable(self, tree: DraftTree) -> bool:
        """The method's LOSSY relaxed rule may apply to this tree (even a
        chain then goes through the tree walk, which applies it)."""
        rule = self._sp_needs.relaxed
        return (rule is not None and tree.sources is not None
                and any(s in rule.sources for s in tree.sources))

    def _sp_relax(self, state: StepState, drafts, greedy: set[int], chosen,
                  logits) -> dict[int, list[int]]:
        """Re-walk the eligible greedy trees under the relaxed rule
        (``engine/verify.relaxed_path``); returns request -> path positions
        whose tokens the rule accepted against the argmax. Eligible: greedy,
        no logprobs, no sampling constraints (``_chain_only``), and relaxed
        for this request under the server's ``relaxed_lossy``
        (``request_flags.wants_relaxed``: a request may opt out, or must
        opt in)."""
        rule = self._sp_needs.relaxed
        mode = self._sp_options.get("relaxed_lossy")
        todo = []
        for i, tree in state.trees.items():
            if i not in greedy or not self._sp_relaxable(tree):
                continue
            req = self.requests.get(self.input_batch.req_ids[i])
            sp = req.sampling_params if req is not None else None
            if sp is not None and not wants_relaxed(sp.extra_args, mode):
                self._sp_stats.relaxed_opted_out += 1
                continue
            if (sp is None or _chain_only(sp) or sp.logprobs is not None
                    or sp.prompt_logprobs is not None):
                self._sp_stats.relaxed_ineligible += 1
                continue
            todo.append(i)
        if not todo:
            return {}
        base, n_rows = state.logit_base, state.logit_rows
        sel = np.concatenate([int(base[i]) + np.arange(int(n_rows[i])) for i in todo])
        vals, ids = log_softmax_topk(logits, rule.beta, to_device(sel, torch.long,
                                                                  logits.device))
        vals, ids = (t.tolist() for t in read_back(vals, ids))
        out, k = {}, 0
        old = list(chosen.paths)
        for i in todo:
            n = int(n_rows[i])
            path, relaxed = relaxed_path(state.trees[i], drafts[i], rule,
                                         ids[k:k + n], vals[k:k + n])
            k += n
            chosen.paths[i] = path
            if relaxed:
                out[i] = [path.index(c) for c in relaxed]
        # keep the flat draft rows aligned with the (possibly longer) paths
        q_rows, k = [], 0
        for i, path in enumerate(old):
            seg = chosen.q_rows[k:k + len(path)]
            k += len(path)
            q_rows.extend([drafts[i][j] for j in chosen.paths[i]] if i in todo else seg)
        chosen.q_rows = q_rows
        return out

    def _sp_move_kv(self, state: StepState, paths, accepted) -> None:
        """The accepted path's K/V to the slots of consecutive positions, from
        the cache's own slots (node j was written at depth-order row j+1)."""
        step = state.attention
        if step is None:
            return
        src, dst = [], []
        for r in step.rows:
            for k, j in enumerate(paths[r.req_index][: accepted[r.req_index]]):
                if j != k:  # node j sits in the slot of row j+1, not k+1
                    src.append(r.row_start + 1 + j)
                    dst.append(r.row_start + 1 + k)
        self._sp_stats.kv_moves += len(src)
        target = self._sp_target
        moves = target.layer_moves
        if moves is None or (moves.head_size, moves.layout) != (target.head_size,
                                                                target.kv_layout):
            moves = target.layer_moves = LayerMoves(target.head_size, target.kv_layout)
        move_accepted_kv(step, src, dst, moves)
