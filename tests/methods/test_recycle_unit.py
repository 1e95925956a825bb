"""`recycle` method on hand-made StepRequests (no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.sources.adjacency import AdjacencyTable
from vllm_specplug.sources.adjacency_drafter import AdjacencyDrafter
from vllm_specplug.engine.interface import Needs, ProposerContext
from vllm_specplug.engine.interface import StepRequest as _StepRequest
from vllm_specplug.methods.recycle import RecycleConfig, RecycleProposer
from vllm_specplug.tenancy import PUBLIC
from tests.methods.budget import propose

VOCAB, K = 100, 8
PERIOD = [5, 9, 3, 7, 11, 2, 40, 41, 42, 43, 44]  # distinct tokens: one successor each


def StepRequest(*args, tenant: str | None = PUBLIC, **kw) -> _StepRequest:
    """The requests of these tests share the public tenant's table unless
    they name another (tests/sources/test_adjacency_tenancy.py isolates)."""
    return _StepRequest(*args, tenant=tenant, **kw)


def _table(p: RecycleProposer, tenant: str = PUBLIC) -> AdjacencyTable:
    """The table a tenant's requests learn in."""
    return p.drafter.tenant_table(tenant)


def _ctx(n_spec: int = 20, max_model_len: int = 4096) -> ProposerContext:
    return ProposerContext(
        vocab_size=VOCAB, hidden_size=16, num_speculative_tokens=n_spec,
        max_model_len=max_model_len, device=torch.device("cpu"), dtype=torch.float32,
        model_path="/models/m", tokenizer_path="/models/m",
    )


def _proposer(n_spec: int = 20, **cfg) -> RecycleProposer:
    return RecycleProposer(RecycleConfig(**cfg), _ctx(n_spec))


def _oracle_topk(seq: list[int], k: int = K) -> torch.Tensor:
    """A perfect 'target': row i's best guess is seq[i+1], then filler."""
    rows = []
    for i, tok in enumerate(seq):
        nxt = seq[i + 1] if i + 1 < len(seq) else 0
        rows.append([nxt] + [60 + (tok + j) % 30 for j in range(k - 1)])
    return torch.tensor(rows)


def _prefill(req_id: str, seq: list[int], sampled: bool = True, **kw) -> StepRequest:
    """A whole-prompt step: rows cover positions 0.. of the prompt."""
    ids = np.array(seq + ([1] if sampled else []), dtype=np.int64)
    return StepRequest(
        req_id=req_id, token_ids=ids, num_prompt_tokens=len(seq), sampled=sampled,
        verified_pos=0, topk_ids=_oracle_topk(seq), **kw,
    )


def _first_path(tree) -> list[int]:
    """Tokens along first children from the root."""
    kids, out, node = tree.children(), [], 0
    while kids[node]:
        child = kids[node][0]
        out.append(tree.tokens[child])
        node = child + 1
    return out


# ---------------------------------------------------------------- config


def test_config_defaults_and_needs():
    cfg = RecycleConfig()
    assert cfg.topk == 8 and cfg.template == "auto" and cfg.copy_path
    assert cfg.table_path is None and cfg.per_request_tables is False
    p = RecycleProposer(cfg, _ctx())
    assert p.needs() == Needs(topk=8, prefill_topk=True, tree_topk=True, topk_probs=False)
    assert RecycleProposer.name == "recycle" and RecycleProposer.config_cls is RecycleConfig
    assert p.drafter.pristine.table.shape == (VOCAB, 8)


def test_config_validation():
    for bad in ({"topk": 0}, {"topk": 17}, {"topk": "8"}, {"template": "nope"},
                {"template": "4,0"}, {"per_request_tables": 1}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            RecycleConfig(**bad)
    assert RecycleConfig(template="4,2,1").build_template().level_sizes() == [4, 2, 1]
    for field in RecycleConfig.model_fields.values():
        assert field.description  # a docstring per field


def test_check_against_names_the_key(tmp_path):
    RecycleConfig().check_against(63)
    with pytest.raises(SpecplugConfigError) as e:
        RecycleConfig(template="graft_d5").check_against(21)
    assert "\n" not in str(e.value) and "'num_speculative_tokens'" in str(e.value)
    with pytest.raises(SpecplugConfigError, match=r"\['table_path'\]"):
        RecycleConfig(table_path=str(tmp_path / "missing")).check_against(8)


# ---------------------------------------------------------------- drafting


def test_repeated_sequence_is_reproduced_as_first_path():
    p = _proposer(n_spec=30, copy_path=False)  # the template alone
    seq = PERIOD * 3
    # The last token of seq plays the freshly sampled one: the prompt rows
    # cover every position before it.
    req = StepRequest(
        req_id="a", token_ids=np.array(seq, dtype=np.int64), num_prompt_tokens=len(seq) - 1,
        sampled=True, verified_pos=0, topk_ids=_oracle_topk(seq)[:-1],
    )
    (tree,) = propose(p, [req])
    tree.validate()
    assert len(tree) <= 30
    start = PERIOD.index(seq[-1]) + 1
    want = (PERIOD * 3)[start : start + 9]  # the template's chain is 9 deep
    assert _first_path(tree) == want
    # Siblings of the first node are the target's runner-up guesses.
    assert tree.tokens[0] == want[0]


def test_unsampled_chunk_learns_but_does_not_draft():
    p = _proposer()
    (out,) = propose(p, [_prefill("a", PERIOD, sampled=False)])
    assert out is None
    assert _table(p).table[5, 0].item() == 9 and _table(p).num_filled() == len(PERIOD)


def test_cold_table_gives_no_draft():
    p = _proposer()
    req = StepRequest("a", np.array([1, 2, 3]), 3, True, 0)
    assert propose(p, [req]) == [None]


def test_decode_step_learns_from_every_tree_node():
    p = _proposer()
    # Prompt [5, 9], sampled 4. The step verifies root 4 with the tree
    # 4 -> {3 -> ., 50 -> 3}: the target accepts 3 and then samples 77.
    tree_tokens = torch.tensor([4, 3, 50, 3])  # root first
    node_topk = torch.tensor([
        [3] + [60] * 7,  # after 4
        [77] + [61] * 7,  # after 4 3 (accepted)
        [8] + [62] * 7,  # after 4 50 (rejected)
        [7] + [63] * 7,  # after 4 50 3 (rejected)
    ])
    req = StepRequest(
        req_id="a", token_ids=np.array([5, 9, 4, 3, 77]), num_prompt_tokens=2, sampled=True,
        verified_pos=2, topk_ids=node_topk[:2],
        node_tokens=tree_tokens, node_topk_ids=node_topk,
    )
    (tree,) = propose(p, [req])
    assert _table(p).table[50, 0].item() == 8  # a rejected node still taught us
    assert _table(p).table[4, 0].item() == 3
    # Token 3 was verified twice; the accepted path's row (the real context)
    # is applied last and wins over the rejected branch's.
    assert _table(p).table[3, 0].item() == 77
    assert _table(p).table[3, 1].item() == 61
    assert tree is None  # nothing known after 77 yet


def test_prefill_rows_given_twice_are_learned_once():
    # The runner passes the prompt rows as topk_ids and as node_* at prefill.
    p = _proposer()
    seq = PERIOD
    topk = _oracle_topk(seq)
    req = StepRequest(
        "a", np.array(seq), len(seq), False, 0, topk_ids=topk,
        node_tokens=torch.tensor(seq), node_topk_ids=topk,
    )
    propose(p, [req])
    assert _table(p).table[5, 0].item() == 9 and _table(p).num_filled() == len(seq)
    assert p.drafter.rows(req)[0][0].tolist() == seq and len(p.drafter.rows(req)[0]) == 1


def test_prompt_rows_with_an_offset_pair_with_their_tokens():
    # a prompt chunk whose top-k covers only its last rows (topk_offset)
    seq = PERIOD * 3
    topk = _oracle_topk(seq)[-4:]
    req = StepRequest("a", np.array(seq), len(seq), False, 0, topk_ids=topk,
                      topk_offset=len(seq) - 4)
    toks, rows = AdjacencyDrafter.rows(req)
    assert torch.cat(toks).tolist() == seq[-4:]
    assert torch.equal(torch.cat(rows), topk)


def test_budget_max_model_len_and_chain_only():
    p = RecycleProposer(RecycleConfig(), _ctx(n_spec=5, max_model_len=40))
    seq = PERIOD * 3  # 33 tokens, 7 left before max_model_len
    learn = StepRequest("a", np.array(seq), len(seq), False, 0, topk_ids=_oracle_topk(seq))
    propose(p, [learn])
    tail = np.array(seq[:-1] + [5], dtype=np.int64)
    req = StepRequest("b", tail, len(tail) - 1, True, len(tail))
    chain = StepRequest("c", tail, len(tail) - 1, True, len(tail), chain_only=True)
    # 38 tokens: one draft node plus the bonus token still fit in 40.
    full = StepRequest("d", np.array(seq * 2)[:38], 38, True, 38)
    done = StepRequest("e", np.array(seq * 2)[:39], 39, True, 39)  # none left
    t_req, t_chain, t_full, t_done = propose(p, [req, chain, full, done])
    assert len(t_req) == 5 and not t_req.is_chain()
    assert t_chain.is_chain() and t_chain.tokens == [9, 3, 7, 11, 2]
    assert len(t_full) == 1 and t_done is None


def test_shared_table_crosses_requests_per_request_tables_do_not():
    for isolated in (False, True):
        p = _proposer(per_request_tables=isolated)
        p.add_request("a")
        p.add_request("b")
        # b's first step comes before a's prompt: its own table is taken then
        assert propose(p, [StepRequest("b", np.array([9]), 1, True, 0)]) == [None]
        propose(p, [_prefill("a", PERIOD, sampled=False)])
        (tree_b,) = propose(p, [StepRequest("b", np.array([9]), 1, True, 0)])
        if isolated:
            # b's own table never saw a's prompt; the tenant's one did, and
            # a request stepping now starts from it
            assert tree_b is None and _table(p).num_filled() == len(PERIOD)
            p.add_request("c")
            (tree_c,) = propose(p, [StepRequest("c", np.array([9]), 1, True, 0)])
            assert tree_c.tokens[0] == 3
            p.remove_request("c")
        else:
            assert tree_b.tokens[0] == 3
    p.remove_request("a")
    p.remove_request("b")
    assert p.drafter._own == {}


def test_warm_start_from_file(tmp_path):
    path = str(tmp_path / "t.safetensors")
    warm = AdjacencyTable(VOCAB, 8, model_id="m")
    warm.update(torch.tensor([9]), _oracle_topk([9, 3])[:1])
    warm.save(path)
    p = _proposer(table_path=path, topk=4)
    assert p.drafter.pristine.k == 4 and p.drafter.pristine.table[9, 0].item() == 3
    (tree,) = propose(p, [StepRequest("a", np.array([9]), 1, True, 0)])
    assert tree.tokens[0] == 3
    AdjacencyTable(VOCAB + 1, 8).save(path)
    with pytest.raises(SpecplugConfigError, match=r"\['table_path'\].*101.*100"):
        _proposer(table_path=path)


def test_stats_report_table_size_and_step_costs():
    import numpy as np
    import torch

    from vllm_specplug.engine.interface import ProposerContext, StepRequest
    from vllm_specplug.methods.recycle import RecycleConfig, RecycleProposer

    ctx = ProposerContext(vocab_size=50, hidden_size=8, num_speculative_tokens=6,
                          max_model_len=64, device=torch.device("cpu"), dtype=torch.float32,
                          model_path="/models/m", tokenizer_path="/models/m")
    prop = RecycleProposer(RecycleConfig(topk=4), ctx)
    assert prop.report()["update"] == {"n": 0}
    req = StepRequest(req_id="a", token_ids=np.array([1, 2, 3]), num_prompt_tokens=2,
                      sampled=True, verified_pos=2)
    req.topk_ids = torch.tensor([[4, 5, 6, 7]])
    req.topk_probs = torch.full((1, 4), 0.25)
    propose(prop, [req])
    st = prop.report()
    # a request without a tenant: its own table next to the start-up one
    assert st["table_bytes"] == 2 * 50 * 4 * 4 and st["tables"] == 2 and st["filled_rows"] == 1
    assert st["tenants"] == 0 and st["live_requests"] == 1
    assert st["update"]["n"] == 1 and st["expand"]["n"] == 1
    # one expansion timed: a positive duration, its own mean, min, max and last
    expand = st["expand"]
    assert expand["mean_ms"] > 0
    assert expand["mean_ms"] == expand["min_ms"] == expand["max_ms"] == expand["last_ms"]
    assert expand["total_s"] == pytest.approx(expand["mean_ms"] / 1e3)


# ------------------------------------------------------------ the copy path


def test_copy_path_when_the_context_repeats():
    """A cold table drafts nothing; once the context repeats 2+ tokens,
    pld's chain is the draft (at most the budget)."""
    p = _proposer(n_spec=8)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    (tree,) = propose(p, [StepRequest("a", np.array(seq), len(seq) - 1, True, len(seq))])
    assert tree.tokens == [3, 4, 5, 6, 7, 8, 9, 10] and tree.is_chain()
    q = _proposer(n_spec=8, copy_path=False)
    assert propose(q, [StepRequest("a", np.array(seq), len(seq) - 1, True, len(seq))]) == [None]
    single = [1, 2, 3, 4, 1]  # a one-token match: repeating only from copy_min_match=1
    assert propose(p, [StepRequest("b", np.array(single), 4, True, 5)])[0].tokens == [2, 3, 4, 1]
    two = _proposer(n_spec=8, copy_min_match=2)
    assert propose(two, [StepRequest("b", np.array(single), 4, True, 5)]) == [None]


def test_copy_and_template_are_cut_by_score():
    """A warm table and a repeating context: copy and template share the
    budget by score; once the copy has proved itself it takes it all."""
    seq = [5, 9, 3, 30, 31, 32, 33, 34, 35, 36, 9, 3]  # "9 3" repeats: copy 30 31 ..
    for proven in (False, True):
        p = _proposer(n_spec=8)
        propose(p, [_prefill("w", PERIOD, sampled=False)])  # row of 3: 7 first
        if proven:
            p.copy.first[1].add(200, 200)
            p.copy.next[1].add(200, 200)
        (tree,) = propose(p, [StepRequest("a", np.array(seq), 11, True, 12)])
        tree.validate()
        assert len(tree) == 8 and tree.scores is not None
        roots = [t for t, q in zip(tree.tokens, tree.parents) if q < 0]
        assert tree.tokens[0] == 30 and tree.parents[:2] == [-1, 0]
        if proven:
            assert tree.is_chain() and tree.tokens == [30, 31, 32, 33, 34, 35, 36, 9]
        else:
            assert 7 in roots and 1 < len(tree.first_path()) < 8


def test_copy_feedback_and_chain_only():
    p = _proposer(n_spec=4)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    req = StepRequest("a", np.array(seq), 10, True, 11, chain_only=True)
    (tree,) = propose(p, [req])
    assert tree.is_chain() and tree.tokens == [4, 5, 6, 7]
    before = p.copy.first[2].value
    nxt = StepRequest("a", np.array(seq + [4, 5, 6, 7, 8]), 10, True, 11, draft_kept=4)
    propose(p, [nxt])
    assert p.copy.first[2].value > before and p.copy.next[2].trials == 3
