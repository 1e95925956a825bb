"""DReSD proposer on hand-made StepRequests over a small store built with the
tiny model: first-token filter, tree validity, draft shapes, budget, startup
checks and config validation."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.datastore import build
from vllm_specplug.datastore.dense import DatastoreError
from vllm_specplug.engine.interface import Needs, ProposerContext, StepRequest
from vllm_specplug.methods.dresd import DReSDConfig, DReSDProposer
from tests.methods.budget import propose, tree_paths

WORDS = ("one two three four five six seven eight nine ten river dog cat tree leaf "
         "draft target sample branch verify").split()
N_NEXT = 21  # 20-token drafts after the filter token


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model_path() -> str:
    from vllm_specplug.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="module")
def store(tmp_path_factory, model_path):
    d = tmp_path_factory.mktemp("dresd")
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 40))) for _ in range(30)]
    (d / "c.txt").write_text("\n".join(docs) + "\n")
    out = d / "store"
    build.build_dense_datastore(model_path, str(out), corpus=str(d / "c.txt"), n_next=N_NEXT,
                                dims=32, chunk_tokens=1024, progress=False)
    model, tok = build._load_model(model_path, "float32")
    ids = [tok(t)["input_ids"] for t in docs]
    hidden = [build._doc_hiddens(model, [x], 4096)[0] for x in ids]
    return {"path": str(out), "ids": ids, "hidden": hidden, "dir": d}


def _ctx(model_path, **kw) -> ProposerContext:
    base = dict(vocab_size=512, hidden_size=256, num_speculative_tokens=64,
                max_model_len=2048, device=torch.device("cpu"), dtype=torch.float32,
                model_path=model_path, tokenizer_path=model_path)
    base.update(kw)
    return ProposerContext(**base)


def _proposer(store, model_path, ctx_kw=None, **cfg) -> DReSDProposer:
    return DReSDProposer(DReSDConfig(datastore=store["path"], **cfg),
                         _ctx(model_path, **(ctx_kw or {})))


def _req(store, doc: int, t: int, *, last: int | None = None, rid="r", **kw) -> StepRequest:
    """Request whose context is doc[:t+1] plus the sampled token doc[t+1]
    (or ``last``); the hidden rows are the prompt's, the last one being the
    state after reading doc[t], which predicted the sampled token."""
    ids = list(store["ids"][doc][: t + 2])
    if last is not None:
        ids[-1] = last
    h = torch.from_numpy(store["hidden"][doc][: t + 1].copy())
    return StepRequest(req_id=rid, token_ids=np.asarray(ids, dtype=np.int64),
                       num_prompt_tokens=t + 1, sampled=True, verified_pos=0, hidden=h, **kw)


def _paths(tree) -> list[list[int]]:
    ch = tree.children()
    leaves = [i for i in range(len(tree)) if not ch[i + 1]]
    return [list(tree_paths(tree)[i]) for i in leaves]


def _allowed(store, last: int) -> set[tuple[int, ...]]:
    """Every continuation the store may legally draft after ``last``."""
    vals = np.load(os.path.join(store["path"], "values.npy"))
    rows = vals[vals[:, 0] == last, 1:]
    return {tuple(int(x) for x in r if x >= 0) for r in rows}


def test_needs_and_shapes(store, model_path):
    p = _proposer(store, model_path)
    assert p.name == "dresd" and p.needs() == Needs(hidden=True)
    assert p.shape_for(_req(store, 0, 5)) == (3, 20)
    assert p.shape_for(_req(store, 0, 5, temperature=0.7)) == (10, 10)
    p2 = _proposer(store, model_path, greedy_max_temperature=0.5)
    assert p2.shape_for(_req(store, 0, 5, temperature=0.3)) == (3, 20)
    p3 = _proposer(store, model_path, greedy_draft_len=50)
    assert p3.shape_for(_req(store, 0, 5)) == (3, N_NEXT - 1)  # capped by the store


def test_greedy_draft_follows_the_corpus(store, model_path):
    p = _proposer(store, model_path)
    doc, t = 3, 10
    (tree,) = propose(p, [_req(store, doc, t)])
    tree.validate()
    assert 1 <= len(tree) <= 64
    truth = store["ids"][doc][t + 2 : t + 2 + 20]
    # Exact context in the store: the first (best) path is the corpus text.
    assert _paths(tree)[0][: len(truth)] == truth or tree.tokens[: len(truth)] == truth
    assert len(_paths(tree)) <= 3
    last = store["ids"][doc][t + 1]
    allowed = _allowed(store, last)
    for path in _paths(tree):
        assert any(a[: len(path)] == tuple(path) for a in allowed)
    s = p.report()
    assert s["query"]["n"] == 1 and s["query"]["mean_ms"] > 0 and s["queries"] == 1


def test_mismatching_first_tokens_are_dropped(store, model_path):
    p = _proposer(store, model_path, num_candidates=32)
    doc, t = 5, 8
    true_next = store["ids"][doc][t + 1]
    vals = np.load(os.path.join(store["path"], "values.npy"))
    firsts = set(vals[:, 0].tolist())
    # A sampled token that starts no stored value: every neighbour is dropped.
    absent = next(x for x in range(3, 512) if x not in firsts)
    (tree,) = propose(p, [_req(store, doc, t, last=absent)])
    assert tree is None
    assert p.report()["dropped_first_token"] == 32 and p.report()["empty"] == 1
    # A different token that does start some values: only those survive.
    other = next(x for x in sorted(firsts) if x != true_next)
    (tree,) = propose(p, [_req(store, doc, t, last=other)])
    allowed = _allowed(store, other)
    if tree is not None:
        tree.validate()
        for path in _paths(tree):
            assert any(a[: len(path)] == tuple(path) for a in allowed)
    # Stripped: no path starts with the filter token itself unless the corpus
    # repeats it.
    (tree,) = propose(p, [_req(store, doc, t)])
    assert tree.tokens[0] == store["ids"][doc][t + 2]


def test_batch_sampling_shape_budget_and_edge_cases(store, model_path):
    p = _proposer(store, model_path, ctx_kw={"num_speculative_tokens": 12})
    reqs = [
        _req(store, 1, 6, rid="a"),
        _req(store, 2, 9, rid="b", temperature=0.8),
        _req(store, 4, 3, rid="c", chain_only=True),
        StepRequest("d", np.asarray([1, 2, 3]), 3, sampled=False, verified_pos=0),
        StepRequest("e", np.asarray([1, 2, 3]), 3, sampled=True, verified_pos=0, hidden=None),
        _req(store, 6, 12, rid="f", temperature=0.8),
    ]
    reqs[-1].hidden = reqs[-1].hidden.to(torch.bfloat16)  # runner dtype may differ
    out = propose(p, reqs)
    assert len(out) == 6 and out[3] is None and out[4] is None
    for tree in (out[0], out[1], out[2], out[5]):
        assert tree is not None
        tree.validate()
        assert len(tree) <= 12
    assert out[2].is_chain()
    assert len(_paths(out[1])) <= 10
    assert max(tree.depths().max() for tree in (out[1], out[5])) <= 10  # 10 x 10 shape
    assert p.report()["query"]["n"] == 1  # one batched query per step
    assert p.report()["no_hidden"] == 1
    # No room left before max_model_len: no query, no draft.
    p2 = _proposer(store, model_path, ctx_kw={"max_model_len": 12})
    assert propose(p2, [_req(store, 1, 10)]) == [None]
    assert p2.report()["query"]["n"] == 0


def test_min_similarity_filters(store, model_path):
    p = _proposer(store, model_path, min_similarity=1.0)
    rng = np.random.default_rng(0)
    req = _req(store, 0, 5)
    req.hidden = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
    assert propose(p, [req]) == [None]
    assert p.report()["dropped_similarity"] > 0


def test_startup_checks(store, model_path, tmp_path):
    with pytest.raises(DatastoreError, match="hidden size mismatch") as e:
        _proposer(store, model_path, ctx_kw={"hidden_size": 576})
    assert "\n" not in str(e.value)
    with pytest.raises(DatastoreError, match="vocab size mismatch"):
        _proposer(store, model_path, ctx_kw={"vocab_size": 49152})
    # A tokenizer with a different vocabulary.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    other = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>").save_pretrained(other)
    with pytest.raises(DatastoreError, match="tokenizer mismatch") as e:
        _proposer(store, model_path, ctx_kw={"tokenizer_path": str(other)})
    assert "\n" not in str(e.value)
    with pytest.raises(DatastoreError, match="no such directory"):
        DReSDProposer(DReSDConfig(datastore=str(tmp_path / "missing")), _ctx(model_path))
    broken = tmp_path / "broken"
    shutil.copytree(store["path"], broken)
    os.remove(broken / "pca_components.npy")
    with pytest.raises(DatastoreError, match="missing file 'pca_components.npy'"):
        DReSDProposer(DReSDConfig(datastore=str(broken)), _ctx(model_path))


def test_config_validation():
    cfg = DReSDConfig(datastore="/x")
    assert (cfg.greedy_num_drafts, cfg.greedy_draft_len) == (3, 20)
    assert (cfg.sampling_num_drafts, cfg.sampling_draft_len) == (10, 10)
    with pytest.raises(ValidationError):
        DReSDConfig()  # datastore is required
    with pytest.raises(ValidationError):
        DReSDConfig(datastore="/x", num_candidates="8")  # strict
    with pytest.raises(ValidationError):
        DReSDConfig(datastore="/x", leaves_to_search=0)
    with pytest.raises(ValidationError):
        DReSDConfig(datastore="/x", unknown_key=1)  # extra=forbid
    with pytest.raises(SpecplugConfigError, match="sampling_num_drafts"):
        DReSDConfig(datastore="/x", num_candidates=4).check_against(64)
    DReSDConfig(datastore="/x", num_candidates=10).check_against(8)
    for name, field in DReSDConfig.model_fields.items():
        assert field.description, f"{name} has no docstring"
