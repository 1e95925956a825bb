"""Per-request control and contained hook faults, on a real engine.

One engine runs ``hook_probe``: pld drafting, recording every call the
runner makes into the method, with faults injected into a chosen hook
between batches. Checked, always against plain decoding's greedy output:

- a request sent with ``specplug_speculate: false`` never reaches the method
  (no add, remove or propose) and drafts nothing, while the request beside
  it in the same batch drafts;
- a fault in ``add_request``, ``remove_request``, ``propose`` or ``stats``
  is counted and the engine keeps serving identical output;
- a request whose ``propose`` fails ``max_request_faults`` times in a row
  stops drafting, and the method never sees it again.

(The HTTP 400s for bad fields are in test_robustness.py.)
"""

from __future__ import annotations

import pytest

from tests.conftest import engine, plain_greedy
from vllm_specplug import registry
from vllm_specplug.methods.pld import PLDProposer

pytestmark = pytest.mark.engine

POISON = 7
MAX_TOKENS = 32
MAX_FAULTS = 2
FAIL_IN: set[str] = set()
"""Hooks that raise now (``propose``: only for batches holding a request
whose prompt holds ``POISON``)."""
CALLS: dict[str, list[str]] = {"add_request": [], "remove_request": [], "propose": []}
PROMPTS: dict[str, tuple[int, ...]] = {}
"""Request id -> prompt, for every request propose saw."""


class HookProbe(PLDProposer):
    name = "hook_probe"

    def add_request(self, req_id):
        CALLS["add_request"].append(req_id)
        if "add_request" in FAIL_IN:
            raise RuntimeError("injected fault in add_request")

    def remove_request(self, req_id):
        CALLS["remove_request"].append(req_id)
        if "remove_request" in FAIL_IN:
            raise RuntimeError("injected fault in remove_request")

    def propose(self, batch):
        for r in batch:
            CALLS["propose"].append(r.req_id)
            PROMPTS[r.req_id] = tuple(r.token_ids[:r.num_prompt_tokens].tolist())
        if "propose" in FAIL_IN and any(POISON in p for p in map(PROMPTS.get, (
                r.req_id for r in batch))):
            raise RuntimeError("injected fault in propose")
        return super().propose(batch)

    def stats(self):
        if "stats" in FAIL_IN:
            raise RuntimeError("injected fault in stats")
        return super().stats()


# Repeating prompts: pld drafts (and gets accepted) on the tiny model.
A = [11, 12, 13, 11, 12, 13, 11, 12, 40, 41]
B = [30, 31, 32, 30, 31, 32, 30, 31, 50]
C = [20, 21, 22, 23, 20, 21, 22, 23, 20]
P = [POISON, 20, 21, 22, 20, 21, 22, 20]


@pytest.fixture(scope="module")
def llm(tiny_model):
    registry.register("hook_probe", "tests.serving.test_request_control:HookProbe")
    spec = {"method": "hook_probe", "num_speculative_tokens": 4, "cost_aware": False,
            "max_request_faults": MAX_FAULTS}
    with engine(tiny_model, spec, max_model_len=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain(tiny_model):
    refs = plain_greedy(tiny_model, [A, B, C, P], MAX_TOKENS)
    return {tuple(p): r for p, r in zip([A, B, C, P], refs)}


def _generate(llm, prompts, xargs=None):
    """Greedy outputs (each prompt with its own extra_args) and the change in
    the runner's counters."""
    from vllm import SamplingParams, TokensPrompt

    before = llm.collective_rpc("specplug_stats")[0]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             extra_args=(xargs or {}).get(i)) for i in range(len(prompts))]
    for calls in CALLS.values():
        calls.clear()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    # generate returns with the last tokens; the runner hears that the
    # requests finished (remove_request) in the engine's next step
    llm.llm_engine.step()
    after = llm.collective_rpc("specplug_stats")[0]
    delta = {k: after[k] - before[k] for k in (
        "drafts", "draft_tokens", "accepted_tokens", "propose_faults", "fault_requests",
        "hook_faults", "requests_stopped_drafting")}
    return [list(o.outputs[0].token_ids) for o in outs], delta


def _seen_prompts() -> set[tuple[int, ...]]:
    return {PROMPTS[r] for r in CALLS["propose"]}


def test_opted_out_request_drafts_nothing_beside_one_that_drafts(plain, llm):
    FAIL_IN.clear()
    outs, delta = _generate(llm, [A, B], {1: {"specplug_speculate": False}})
    assert outs == [plain[tuple(A)], plain[tuple(B)]]
    assert _seen_prompts() == {tuple(A)}  # B never reached propose
    # one add and one remove: A's (B never reached the method)
    assert len(CALLS["add_request"]) == 1 and len(CALLS["remove_request"]) == 1
    assert CALLS["add_request"] == CALLS["remove_request"]
    assert delta["drafts"] > 0 and delta["draft_tokens"] > 0  # A drafted

    outs, delta = _generate(llm, [A, B], {0: {"specplug_speculate": 0},
                                          1: {"specplug_speculate": False}})
    assert outs == [plain[tuple(A)], plain[tuple(B)]]
    assert delta["drafts"] == 0 and delta["draft_tokens"] == 0
    assert not any(CALLS.values())


@pytest.mark.parametrize("hook", ["add_request", "remove_request", "stats"])
def test_fault_in_a_hook_keeps_identical_output(plain, llm, hook):
    FAIL_IN.clear()
    FAIL_IN.add(hook)
    try:
        outs, delta = _generate(llm, [A, B, C])
        if hook == "stats":
            stats = llm.collective_rpc("specplug_stats")[0]
            assert "error" in stats["method"]
    finally:
        FAIL_IN.clear()
    assert outs == [plain[tuple(p)] for p in (A, B, C)]
    expected = {"add_request": 3, "remove_request": 3, "stats": 1}[hook]
    assert delta["hook_faults"] == expected  # stats: the 'before' snapshot's call
    assert delta["drafts"] > 0 and delta["requests_stopped_drafting"] == 0
    assert llm.collective_rpc("specplug_stats")[0]["live_trees"] == 0


def test_request_failing_in_propose_stops_drafting_others_keep_drafting(plain, llm):
    FAIL_IN.clear()
    FAIL_IN.add("propose")
    try:
        outs, delta = _generate(llm, [A, P, B])
    finally:
        FAIL_IN.clear()
    assert outs == [plain[tuple(p)] for p in (A, P, B)]
    assert delta["requests_stopped_drafting"] == 1
    # MAX_FAULTS faulty steps, each: the batch call and P's retry alone; then
    # the method never sees P again
    assert delta["propose_faults"] == MAX_FAULTS and delta["fault_requests"] == MAX_FAULTS
    poisoned = [r for r in CALLS["propose"] if PROMPTS[r] == tuple(P)]
    assert len(poisoned) == 2 * MAX_FAULTS
    assert delta["drafts"] > 0  # A and B kept drafting
    assert _seen_prompts() == {tuple(A), tuple(P), tuple(B)}
