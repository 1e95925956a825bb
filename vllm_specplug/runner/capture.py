"""What methods read from a step's forward, the ``capture`` part of a step:
top-k probabilities and entropies of the logits rows they read (in
``_sample``), the hidden-state rows they asked for (one gather a step), and
each request's share of them for its ``StepRequest``."""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_specplug.engine.transfer import to_device
from vllm_specplug.runner.logit_rows import entropy as _entropy
from vllm_specplug.runner.logit_rows import topk_ids as _topk_ids
from vllm_specplug.runner.logit_rows import topk_probs as _topk_probs
from vllm_specplug.runner.step_state import RequestPlan, StepState



def _selected_rows(want: list[int], logits) -> tuple[torch.Tensor, np.ndarray]:
    """The distinct logits rows in ``want`` (on the logits' device) and, per
    row of the step, its position among them (-1: not selected)."""
    n_rows = logits.shape[0]
    sel = np.unique(np.asarray(want, dtype=np.int64))
    sel = sel[sel < n_rows]
    where = np.full(n_rows, -1, dtype=np.int64)
    where[sel] = np.arange(len(sel))
    return to_device(sel, torch.long, logits.device), where


def _topk(logits, k: int, rows, with_probs: bool):
    """``(probs, ids)`` of the top-``k`` of ``logits`` rows; probs None
    unless ``with_probs`` (``Needs.topk_probs``)."""
    if with_probs:
        return _topk_probs(logits, k, rows)
    return None, _topk_ids(logits, k, rows)


class CaptureMixin:
    """Top-k, entropy and hidden-state capture (see module doc)."""

    def _sp_entropy(self, logits, state: StepState) -> None:
        """Entropy of each request's accepted logits rows (the root and the
        accepted path), from the raw logits: only when a method asks."""
        if not self._sp_needs.entropy or logits is None:
            return
        skip = self._sp_silent_rows()
        want = [int(base) + r for i, base in enumerate(state.logit_base) if i not in skip
                for r in state.accepted_rows.get(i, [0])]
        if not want:
            return
        idx, where = _selected_rows(want, logits)
        state.entropy = (_entropy(logits, idx), where)

    def _sp_topk(self, logits, state: StepState) -> None:
        """Top-k probabilities of only the logits rows methods read: each
        request's accepted rows (every row of its tree with ``tree_topk``)."""
        needs = self._sp_needs
        k = max(needs.topk, 8 if needs.tree_topk else 0)
        if not k or logits is None:
            return
        n_per = state.logit_rows
        want = []
        skip = self._sp_silent_rows()
        for i, base in enumerate(state.logit_base):
            if i in skip:
                continue
            rel = (range(int(n_per[i])) if needs.tree_topk
                   else state.accepted_rows.get(i, [0]))
            want.extend(int(base) + r for r in rel)
        if not want:
            return
        idx, where = _selected_rows(want, logits)
        vals, ids = _topk(logits, k, idx, needs.topk_probs)
        state.topk = (ids, vals, where)

    def _sp_gather(self, hidden_states, aux_hidden_states, rows: list[np.ndarray]):
        """The rows methods read (``rows``: each request's, in batch order)
        of the hidden states they asked for, gathered once for the step:
        ``(hidden, layer_hidden, aux_hidden)``, None where not asked; request
        ``i``'s rows are a slice of each. One index_select per tensor instead
        of four or five small ATen calls per request (~8 us each on a 2-core
        CPU: ~1 % of a batch-8 step for a method that only holds rows while
        its gate is closed)."""
        needs = self._sp_needs
        want_layer = needs.hidden_layer is not None and bool(aux_hidden_states)
        want_aux = bool(needs.aux_layers) and bool(aux_hidden_states)
        if not rows or not (needs.hidden or want_layer or want_aux):
            return None, None, None
        idx = to_device(np.concatenate(rows), torch.long, hidden_states.device)
        hid = hidden_states.index_select(0, idx) if needs.hidden else None
        layer_hid = aux = None
        if want_layer:
            layer_hid = aux_hidden_states[self._sp_target.aux_index[needs.hidden_layer + 1]
                                          ].index_select(0, idx)
        if want_aux:
            aux = torch.cat([aux_hidden_states[self._sp_target.aux_index[x]].index_select(0, idx)
                             for x in needs.aux_layers], dim=-1)
        return hid, layer_hid, aux

    def _sp_fill_entropy(self, sreq, state, i: int, plan: RequestPlan, hidden_states,
                         rows) -> None:
        """Batch row ``i``'s entropies: its accepted rows' when decoding (from
        ``state``), an LM-head pass over a prompt chunk's last rows."""
        rel = plan.rows
        if plan.decoding:
            if state is None or state.entropy is None:
                return
            ent, where = state.entropy
            base = int(state.logit_base[i])
            lrows = where[[base + r for r in rel]]
            if (lrows >= 0).all():
                sreq.entropy = ent[to_device(lrows, torch.long, ent.device)]
        elif len(rows):
            # a prompt chunk: only its last row has logits, so run the LM
            # head over the last few rows (the trigger looks back a few)
            last = rows[-self._sp_needs.prompt_entropy_rows:]
            sreq.entropy = _entropy(self.model.compute_logits(hidden_states[last]))

    def _sp_fill_topk(self, sreq, state, i: int, plan: RequestPlan, hidden_states, rows,
                      side_work: bool = True) -> None:
        """Batch row ``i``'s top-k (and, with ``Needs.tree_topk``, its tree
        rows' top-k ids and tokens). ``side_work``: the budget allows side work (its gate is open and
        drafting has paid once). Otherwise the prompt's LM-head pass
        (``Needs.prefill_topk``) is skipped: it only serves drafts, which do
        not pay now (or have not paid yet), and over a long prompt it costs
        about a fifth of the prefill. A closed gate's exploring steps skip
        it too: one decoding request drafts there, and a prompt arriving in
        such a step would pay the whole pass for that one request's draft."""
        needs = self._sp_needs
        if state is None or state.topk is None:
            return
        rel, first, n_sched = plan.rows, plan.first_row, plan.scheduled
        ids, vals, where = state.topk
        base = int(state.logit_base[i])
        if plan.decoding:
            lrows = to_device(where[[base + r for r in rel]], torch.long, ids.device)
            sreq.topk_ids = ids[lrows]
            sreq.topk_probs = vals[lrows] if vals is not None else None
            if needs.tree_topk:
                # Every verified row of the tree (root + nodes), accepted or not.
                n1 = int(state.logit_rows[i])
                root = int(state.root_row[i])
                sreq.node_tokens = self.input_ids.gpu[root : root + n1].clone()
                sreq.node_topk_ids = ids[to_device(where[base : base + n1], torch.long,
                                                   ids.device)]
        elif needs.prefill_topk and n_sched > 0 and side_work:
            t0 = time.perf_counter()
            # the chunk's last rows only (Needs.prefill_topk_rows)
            skip = max(0, len(rows) - needs.prefill_topk_rows)
            v, t = _topk(self.model.compute_logits(hidden_states[rows[skip:]]),
                         ids.shape[-1], None, needs.topk_probs)
            sreq.topk_ids, sreq.topk_probs, sreq.topk_offset = t, v, skip
            sreq.node_tokens = self.input_ids.gpu[first + skip : first + n_sched].clone()
            sreq.node_topk_ids = t
            # drafting-only work outside the proposer: the budget's gate
            # weighs it with the drafting cost (engine/budget.DraftGate)
            self._sp_clock.side_seconds += time.perf_counter() - t0
        elif sreq.sampled:
            # Only the prompt's last position has logits without prefill_topk.
            row = to_device([where[base]], torch.long, ids.device)
            sreq.topk_ids = ids[row]
            sreq.topk_probs = vals[row] if vals is not None else None
            sreq.topk_offset = n_sched - 1  # it follows the chunk's last token
