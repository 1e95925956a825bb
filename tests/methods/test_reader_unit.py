"""`reader` without an engine: SearchPath (Alg. 2) and the tree it merges
(widening, deepening, Alg. 3) on hand-made contexts and a real suffix
array, and every start-up error (budget, each datastore fault) through
vLLM's own config building."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.methods.budget import tree_paths

from vllm_specplug.config import SpecplugConfigError
from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.methods.reader import ReaderConfig, reader_tree, search_path
from vllm_specplug.registry import resolve
from vllm_specplug.sources.context_index import ContextIndex
from vllm_specplug.sources.suffix_array import TokenSuffixArray


def _index(tokens, n=4):
    idx = ContextIndex(n)
    idx.sync(tokens)
    return idx


def test_search_follows_the_context():
    hist = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    path, shares = search_path(hist, 5, 4, _index(hist), None)
    # key [9,1,2,3] is new; backs off to [1,2,3] -> 4, then [1,2,3,4] -> 5 ...
    assert path == [4, 5, 6, 9, 1] and shares == [1.0] * 5


def test_search_stops_when_nothing_matches_and_depth_zero():
    hist = [1, 2, 3]
    assert search_path(hist, 4, 4, _index(hist), None) == ([], [])
    assert search_path([1, 2, 1], 0, 4, _index([1, 2, 1]), None) == ([], [])


def test_union_is_ranked_by_summed_frequency():
    # context: after 7 comes 8 once; store: after 7 comes 5 twice, 8 once
    hist = [7, 8, 3, 7]
    store = TokenSuffixArray.from_documents([[7, 5, 7, 5, 7, 8]], vocab_size=16)
    path, shares = search_path(hist, 1, 2, _index(hist), store)
    assert path == [8] and shares == [pytest.approx(2 / 4)]  # 8: 1 + 1 vs 5: 2 (tie -> context)
    path, _ = search_path(hist, 1, 2, _index(hist), store, context_weight=0.5)
    assert path == [5]
    # the datastore alone continues a key the context never saw
    path, _ = search_path([3, 7, 5], 3, 3, _index([3, 7, 5]), store)
    assert path == [7, 5, 7]


def test_longer_key_wins_over_frequency_of_a_shorter_one():
    # [4, 7] -> 9 once (context) beats [7] -> 5 many times (store):
    # the longest key found decides, as in the paper's backoff
    hist = [4, 7, 9, 0, 4, 7]
    store = TokenSuffixArray.from_documents([[7, 5]] * 5, vocab_size=16)
    path, _ = search_path(hist, 1, 2, _index(hist), store)
    assert path == [9]


def _cfg(**kw):
    return ReaderConfig(**{"d_search": 4, "d_deep": 3, "l_suffix": 4, **kw})


def _draft():
    # best path 10 -> 11 -> 12, a sibling 20, scores = cumulative log-probs
    return DraftTree([10, 11, 12, 20, 13, 21], [-1, 0, 1, -1, 2, 3],
                     scores=[-0.1, -0.2, -0.3, -1.0, -1.5, -2.0], sources=["eagle3"] * 6)


def test_tree_widens_at_the_root_and_deepens_at_depth_two():
    hist = [10, 11, 30, 31, 32, 33, 5, 6, 40, 41, 42, 43, 44, 5, 6]
    cfg = _cfg()

    def search(ctx, depth):
        return search_path(ctx, depth, cfg.l_suffix, _index(hist), None)

    tree, added = reader_tree(hist, _draft(), 16, cfg, search)
    paths = dict(zip(tree_paths(tree), tree.sources))
    # widening: after [.., 5, 6] the history continued 40 41 42 43
    assert paths[(40, 41, 42, 43)] == "search"
    # deepening: context + [10, 11] continues 30 31 32 under the depth-2 node
    assert paths[(10, 11, 30, 31, 32)] == "deep" and paths[(10, 11)] == "eagle3"
    assert added == {"search": 4, "deep": 3}
    # the draft fills the rest (all 6 of its nodes fit in 16)
    assert sum(s == "eagle3" for s in tree.sources) == 6 and len(tree) == 13
    # best draft path stays first (depth-first layout, first insert first)
    assert tree.tokens[:3] == [10, 11, 12]


def test_duplicates_merge_and_free_slots_go_to_the_draft():
    # the search path repeats the best draft path: shared nodes, then deeper
    hist = [1, 10, 11, 12, 13, 14, 1]
    cfg = _cfg(d_deep=0)

    def search(ctx, depth):
        return search_path(ctx, depth, cfg.l_suffix, _index(hist), None)

    budget = 2 + cfg.d_search  # draft core: its best 2 nodes, 10 -> 11
    tree, added = reader_tree(hist, _draft(), budget, cfg, search)
    paths = dict(zip(tree_paths(tree), tree.sources))
    # the path 10 11 12 13 shares the core's 10 11 and adds 12 13
    assert paths[(10, 11)] == "eagle3" and added["search"] == 2
    assert paths[(10, 11, 12)] == paths[(10, 11, 12, 13)] == "search"
    # the 2 slots the sharing freed go to the next-best draft nodes (20, 21);
    # the draft's own 12 and 13 are already there
    assert paths[(20,)] == paths[(20, 21)] == "eagle3"
    assert len(tree) == budget and len(set(tree_paths(tree))) == len(tree)


def test_no_draft_still_searches_and_budget_caps_everything():
    hist = [1, 2, 3, 4, 5, 1, 2]
    cfg = _cfg(d_search=8, d_deep=2)

    def search(ctx, depth):
        return search_path(ctx, depth, cfg.l_suffix, _index(hist), None)

    tree, added = reader_tree(hist, None, 16, cfg, search)
    assert tree.tokens == [3, 4, 5, 1, 2, 3, 4, 5] and added["deep"] == -1
    tree, _ = reader_tree(hist, _draft(), 3, cfg, search)  # runner's budget below N
    assert len(tree) == 3 and tree.tokens[0] == 10
    assert reader_tree([1], None, 16, _cfg(d_search=0), search)[0] is None


# ------------------------------------------------------------------ start-up


def test_budget_check_names_the_option():
    with pytest.raises(SpecplugConfigError, match=r"num_speculative_tokens.*d_search \(8\)"):
        resolve({"method": "reader", "num_speculative_tokens": 12})
    method, cfg, _ = resolve({"method": "reader", "num_speculative_tokens": 13})
    assert method == "reader" and (cfg.d_search, cfg.d_deep, cfg.l_suffix) == (8, 4, 6)
    resolve({"method": "reader", "num_speculative_tokens": 2, "d_search": 1, "d_deep": 0})
    with pytest.raises(SpecplugConfigError, match="l_suffix"):
        resolve({"method": "reader", "num_speculative_tokens": 16, "l_suffix": 0})


def _create(model: str, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.plugin import register

    register()
    return EngineArgs(model=model, speculative_config=spec, dtype="float32",
                      max_model_len=512).create_engine_config()


@pytest.fixture(scope="module")
def ref_store(tmp_path_factory, ref_model):
    from vllm_specplug.datastore.suffix_array import build_sa_datastore

    root = tmp_path_factory.mktemp("reader_sa")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}"}) + "\n"
                              for i in range(20)))
    build_sa_datastore(ref_model, str(root / "store"), [str(corpus)], progress=False)
    return str(root / "store")


def _fault(store, tmp_path, how):
    d = str(tmp_path / "bad")
    shutil.copytree(store, d)
    if how == "missing folder":
        shutil.rmtree(d)
    elif how == "missing file":
        os.remove(os.path.join(d, "sa.npy"))
    elif how == "truncated":
        p = os.path.join(d, "tokens.npy")
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) - 2)
    elif how == "corrupt":
        p = os.path.join(d, "sa.npy")
        with open(p, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
    else:  # other tokenizer
        p = os.path.join(d, "manifest.json")
        m = json.load(open(p))
        m["tokenizer_fingerprint"] = "vocab-sha256:00"
        json.dump(m, open(p, "w"))
    return d


FAULTS = [("missing folder", "no such folder"), ("missing file", "sa.npy: missing"),
          ("truncated", "truncated or replaced"), ("corrupt", "checksum mismatch"),
          ("other tokenizer", "another tokenizer")]


@pytest.mark.parametrize("how,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_every_datastore_fault_is_one_line_at_startup(ref_model, ref_store, tmp_path,
                                                      how, message):
    spec = {"method": "reader", "num_speculative_tokens": 16,
            "datastore": _fault(ref_store, tmp_path, how)}
    with pytest.raises(SpecplugConfigError) as err:
        _create(ref_model, spec)
    text = str(err.value)
    assert text.startswith("speculative_config['datastore']") and message in text, text
    assert "\n" not in text


def test_good_store_passes_startup(ref_model, ref_store):
    _create(ref_model, {"method": "reader", "num_speculative_tokens": 16,
                        "datastore": ref_store})
