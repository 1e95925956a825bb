"""Drafting, the ``draft`` part of a step: one ``StepRequest`` per request
(ids, hidden states, top-k, entropies), the method asked through its guard,
its trees fitted to each request's budget and kept for the next step's
verification."""

from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np
import torch

from vllm.logger import init_logger

from vllm_specplug.engine.budget import pick_explorer
from vllm_specplug.engine.interface import StepRequest, draft_budget
from vllm_specplug.engine.transfer import read_back, to_device
from vllm_specplug.engine.tree import DraftTree, normalize_tree
from vllm_specplug.metrics import WorkerCounters, worker_counters
from vllm_specplug.runner.guard import guard_for
from vllm_specplug.runner.step_state import RequestPlan, tp_rank0_float
from vllm_specplug.runner.verify_step import _chain_only, _num_real
from vllm_specplug.tenancy import request_tenant

logger = init_logger("vllm.specplug.runner")


class Asked(enum.Enum):
    """Which requests a step asks for a draft."""

    EVERY_REQUEST = "every"
    ONE_REQUEST = "one"  # a closed gate's exploring step
    NO_REQUEST = "none"


@dataclasses.dataclass(frozen=True)
class DraftAsk:
    """Which batch rows this step asks for a draft."""

    who: Asked
    row: int | None = None
    """The batch row asked, with ``Asked.ONE_REQUEST``."""

    def asks(self, row: int) -> bool:
        return self.who is Asked.EVERY_REQUEST or (
            self.who is Asked.ONE_REQUEST and row == self.row)


class DraftMixin:
    """The step's clock and counters, and ``propose_draft_token_ids`` (see
    module doc)."""

    def execute_model(self, scheduler_output, *args, **kwargs):
        # start of the step's clock (forward + verification), for the
        # cost-aware budget's step-cost curve
        self._sp_clock.step_start = time.perf_counter()
        return self._sp_with_counters(
            super().execute_model(scheduler_output, *args, **kwargs))

    def sample_tokens(self, *args, **kwargs):
        # propose runs in here: its counters ride on this step's output
        return self._sp_with_counters(super().sample_tokens(*args, **kwargs))

    def _sp_with_counters(self, output):
        """``output``, carrying the runner's counters to the server's
        /metrics when they changed (``metrics.WorkerCounters``)."""
        try:
            channel = self.__dict__.get("_sp_counter_channel")
            if channel is None:
                channel = self._sp_counter_channel = WorkerCounters()
            channel.attach(output, worker_counters(self._sp_stats))
        except Exception:  # noqa: BLE001 - metrics never cost a step
            pass
        return output

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # vLLM drafts for no request once the batch's longest sequence is
        # within num_speculative_tokens of max_model_len: one long request
        # would switch drafting off for every other one in the batch (the
        # larger num_speculative_tokens, the earlier). Each request's tree is
        # cut to its own room instead
        # (engine/interface.draft_budget).
        return common_attn_metadata is not None

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        t0 = time.perf_counter()
        step_seconds = t0 - self._sp_clock.step_start if self._sp_clock.step_start is not None else 0.0
        # the budget's gate: no draft at all this step when drafting has
        # stopped paying for its own time (engine/budget.DraftGate)
        drafting = self._sp_budget.draft_now()
        batch, plan = self._sp_step_requests(scheduler_output, sampled_token_ids,
                                             hidden_states, aux_hidden_states, drafting)
        all_decode = all(p.decoding for p in plan)
        t1 = time.perf_counter()
        trees = self._sp_ask_method(batch)
        t2 = time.perf_counter()
        if all_decode:
            # rank 0's time: every tensor-parallel rank must gate alike
            self._sp_budget.observe_propose(tp_rank0_float(t2 - t1), drafting,
                                            sum(1 for r in batch if r.budget > 0))
        kept = self._sp_fit_trees(batch, trees)
        try:
            kept = self._sp_apply_budget(batch, kept, scheduler_output,
                                         step_seconds if all_decode else 0.0)
        except Exception:  # noqa: BLE001 - a budget bug must not stop serving
            # the trees stay uncut (still lossless); say so once
            if not self._sp_stats.budget_faults:
                logger.exception("specplug: cost-aware budget failed; trees uncut")
            self._sp_stats.budget_faults += 1
        drafts = self._sp_keep_trees(batch, kept)
        self._sp_stats.record_propose(t1 - t0, t2 - t1)
        if self._sp_requests.sourced:  # forget finished requests
            for rid in [r for r in self._sp_requests.sourced if r not in self.requests]:
                del self._sp_requests.sourced[rid]
        return drafts

    def _sp_step_requests(self, scheduler_output, sampled_token_ids, hidden_states,
                          aux_hidden_states, drafting: bool):
        """The method's input: one ``StepRequest`` per batch row, with its
        rows of hidden states, top-k and entropies; and the step's plan."""
        # read from the step-cost curve only for a step that drafts
        token_s = self._sp_token_seconds(sampled_token_ids) if drafting else 0.0
        side_work = self._sp_budget.side_work
        silent = self._sp_silent()
        plan = self._sp_plan(scheduler_output, silent)
        ask = self._sp_draft_ask(drafting, plan, sampled_token_ids, silent)
        step_rows = self._sp_gather(hidden_states, aux_hidden_states,
                                    [p.first_row + np.asarray(p.rows, dtype=np.int64)
                                     for p in plan])
        state, needs = self._sp_state, self._sp_needs
        batch: list[StepRequest] = []
        at = 0
        for i, rid in enumerate(self.input_batch.req_ids):
            p = plan[i]
            sreq = self._sp_step_request(i, rid, p, scheduler_output, sampled_token_ids[i],
                                         token_s, ask.asks(i) and rid not in silent)
            _attach_rows(sreq, step_rows, at, len(p.rows))
            at += len(p.rows)
            batch.append(sreq)
            if rid in silent:
                continue  # no LM-head side work for it
            # a prompt chunk's rows also feed an LM-head pass (top-k, entropy)
            rows = None if p.decoding else to_device(
                p.first_row + np.asarray(p.rows), torch.long, hidden_states.device)
            # a prompt's LM-head pass only with the gate open and proven
            # (engine/budget.DraftGate.side_work): in a closed gate's
            # exploring step only one decoding request drafts
            self._sp_fill_topk(sreq, state, i, p, hidden_states, rows, side_work)
            if needs.entropy:
                self._sp_fill_entropy(sreq, state, i, p, hidden_states, rows)
            self._sp_count_sources(sreq)
        if needs.rows_on_host:
            _rows_to_host(batch)
        if drafting:
            # rank 0's time, as every budget input (ranks must gate alike)
            self._sp_budget.observe_side(tp_rank0_float(self._sp_clock.side_seconds))
        self._sp_clock.side_seconds = 0.0
        return batch, plan

    def _sp_token_seconds(self, sampled_token_ids) -> float:
        """What an accepted token saves (engine/interface.StepRequest.token_seconds),
        from the step-cost curve (rank 0's times, so alike on every rank).
        0 under tensor parallelism: a head weighs it against its own pass
        time, which each rank measures for itself, and ranks must draft alike."""
        if self.parallel_config.tensor_parallel_size != 1:
            return 0.0
        return self._sp_budget.token_seconds(sum(1 for x in sampled_token_ids if len(x) > 0))

    def _sp_plan(self, scheduler_output, silent: set[str]) -> list[RequestPlan]:
        """Each batch row's part in this step (``RequestPlan``)."""
        qsl = self.query_start_loc.np
        state = self._sp_state
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        plan = []
        for i, rid in enumerate(self.input_batch.req_ids):
            n_sched = scheduler_output.num_scheduled_tokens[rid]
            c = int(self.input_batch.num_computed_tokens_cpu[i])
            n_prompt = int(self.input_batch.num_prompt_tokens[i])
            is_decode = rid in scheduled or (n_sched == 1 and c >= n_prompt)
            if is_decode:  # rows relative to the root (vLLM: the last m+1 rows)
                rel = state.accepted_rows.get(i, [0])
                first = int(state.root_row[i])
            else:
                rel, first = list(range(n_sched)), int(qsl[i])
            if rid in silent:
                rel = []  # no rows gathered for a request that drafts nothing
            plan.append(RequestPlan(n_sched, c, n_prompt, is_decode, rel, first))
        return plan

    def _sp_draft_ask(self, drafting: bool, plan, sampled_token_ids, silent) -> DraftAsk:
        """Every request, when the gate is open; one, in a closed gate's
        exploring step; none otherwise."""
        if not drafting:
            return DraftAsk(Asked.NO_REQUEST)
        if not self._sp_budget.exploring:
            return DraftAsk(Asked.EVERY_REQUEST)
        row = self._sp_pick_explorer(plan, sampled_token_ids, silent)
        if row is None:  # none samples: nobody drafts
            return DraftAsk(Asked.NO_REQUEST)
        return DraftAsk(Asked.ONE_REQUEST, row)

    def _sp_step_request(self, i: int, rid: str, p: RequestPlan, scheduler_output,
                         sampled_ids, token_s: float, asked: bool) -> StepRequest:
        """Batch row ``i``'s ``StepRequest``, rows not attached yet."""
        ntok = int(self.input_batch.num_tokens_no_spec[i])
        req = self.requests.get(rid)
        sp = req.sampling_params if req is not None else None
        sampled = len(sampled_ids) > 0
        return StepRequest(
            req_id=rid,
            token_ids=self.input_batch.token_ids_cpu[i, :ntok],
            num_prompt_tokens=p.prompt_len,
            sampled=sampled,
            verified_pos=p.computed,
            temperature=float(sp.temperature) if sp is not None else 0.0,
            chain_only=_chain_only(sp),
            draft_kept=_num_real(scheduler_output.scheduled_spec_decode_tokens.get(rid, ())),
            token_seconds=token_s,
            drafting=asked,
            budget=draft_budget(
                self.speculative_config.num_speculative_tokens,
                scheduler_output.num_spec_tokens_to_schedule,
                self.max_model_len, ntok, sampled)
            if asked else 0,
            tenant=request_tenant(sp),
        )

    def _sp_ask_method(self, batch: list[StepRequest]) -> list[DraftTree | None]:
        """The method's trees. A method bug must not take the server down
        (runner/guard.py); the method never sees the requests that opted out
        or stopped drafting."""
        guard = guard_for(self)
        trees = guard.propose(self._sp_proposer, batch,
                              skip=self._sp_requests.opted_out | guard.stopped)
        self._sp_stop_drafting(guard.take_stopped())
        return trees

    @staticmethod
    def _sp_fit_trees(batch, trees) -> list[DraftTree | None]:
        """Each tree normalised to its request's budget; a first path only
        for a request whose sampling only a chain verifier handles."""
        kept: list[DraftTree | None] = []
        for sreq, tree in zip(batch, trees):
            if tree is None or sreq.budget <= 0:
                kept.append(None)
                continue
            tree = normalize_tree(tree, sreq.budget)
            if sreq.chain_only and not tree.is_chain():
                tree = tree.first_path()
            kept.append(tree)
        return kept

    def _sp_keep_trees(self, batch, kept) -> list[list[int]]:
        """Keep the trees for the next step's verification; their tokens
        are the drafts vLLM schedules."""
        drafts: list[list[int]] = []
        for sreq, tree in zip(batch, kept):
            if tree is None or not len(tree):
                self._sp_requests.trees.pop(sreq.req_id, None)
                drafts.append([])
                continue
            self._sp_requests.trees[sreq.req_id] = tree
            if tree.sources is not None:
                self._sp_requests.sourced[sreq.req_id] = (tree, len(sreq.token_ids))
            drafts.append(tree.tokens)
        return drafts

    def _sp_count_sources(self, sreq: StepRequest) -> None:
        """Accepted tokens per source of the request's previous tree: the
        kept prefix, followed along what the history gained (bonus token
        excluded)."""
        tree, base = self._sp_requests.sourced.pop(sreq.req_id, (None, 0))
        if tree is not None and sreq.draft_kept > 0:
            self._sp_stats.record_sources(tree.truncated(sreq.draft_kept),
                                          sreq.token_ids[base:-1])

    def _sp_pick_explorer(self, plan: list[RequestPlan], sampled_token_ids,
                          silent: set[str]) -> int | None:
        """The request a closed gate's exploring step asks for a draft:
        round robin, cheap catch-up first (engine/budget.pick_explorer);
        never one in ``silent`` (it drafts nothing). None: no request can
        draft."""
        self._sp_clock.explore_turn += 1
        guard, prop = guard_for(self), self._sp_proposer
        rows = []
        for rid, p, s in zip(self.input_batch.req_ids, plan, sampled_token_ids):
            if len(s) == 0 or rid in silent:  # only these can draft
                rows.append(None)
            elif self._sp_unseen(rid):
                rows.append(0)  # nothing held for it: the method no longer sees it
            else:
                rows.append(guard.call(
                    "catch_up_rows", lambda rid=rid, n=len(p.rows): prop.catch_up_rows(rid, n),
                    rid, default=0))
        # Rank 0's pick: catch-up rows and stopped requests are each rank's
        # own, and ranks that gave different requests a budget would verify
        # different trees.
        pick = pick_explorer(self._sp_clock.explore_turn, rows)
        if self.parallel_config.tensor_parallel_size > 1:
            pick = int(tp_rank0_float(float(pick)))
        return pick if pick >= 0 else None  # pick_explorer: -1 when none can draft


_HOST_ROWS = ("hidden", "layer_hidden", "topk_ids", "topk_probs", "entropy")
"""The ``StepRequest`` fields ``Needs.rows_on_host`` brings to the host."""


def _rows_to_host(batch: list[StepRequest]) -> None:
    """Every request's ``_HOST_ROWS`` as host tensors, in one device->host
    copy for the step (``engine/transfer.read_back``)."""
    slots = [(r, f) for r in batch for f in _HOST_ROWS if getattr(r, f) is not None]
    for (r, f), t in zip(slots, read_back(*(getattr(r, f) for r, f in slots))):
        setattr(r, f, t)


def _attach_rows(sreq: StepRequest, step_rows, at: int, n: int) -> None:
    """The request's slice ``at:at+n`` of the step's gathered hidden rows."""
    hid, layer_hid, aux = step_rows
    if hid is not None:
        sreq.hidden = hid[at:at + n]
    if layer_hid is not None:
        sreq.layer_hidden = layer_hid[at:at + n]
    if aux is not None:
        sreq.aux_hidden = aux[at:at + n]
