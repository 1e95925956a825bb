"""The head runtime (``eagle3/runtime.py``) against the slow reference,
``Eagle3Draft.chain`` (which recomputes the whole prefix per call): the shipped
head, the reference model's real aux features (transformers), float32.

Expected values never come from runtime.py: they come from ``chain()`` and
the head's own projections over the full prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.sources.template import TreeTemplate


@pytest.fixture(scope="module")
def setup(ref_model):
    from transformers import AutoTokenizer

    from vllm_specplug.eagle3 import shipped_head_path
    from vllm_specplug.eagle3.data import _AuxCapture
    from vllm_specplug.eagle3.model import load_head

    head_dir = shipped_head_path()
    cap = _AuxCapture(ref_model, (2, 15, 27))
    embed = cap.base.get_input_embeddings().weight.detach()
    head = load_head(head_dir, embed).eval()
    tok = AutoTokenizer.from_pretrained(ref_model)
    text = ("The quick brown fox jumps over the lazy dog. To compute 12 * 7, first "
            "multiply 10 by 7 to get 70, then 2 by 7 to get 14, and add them: 84. "
            "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n")
    ids = tok(text)["input_ids"]
    aux, _ = cap(torch.tensor([ids]))  # run_target's batched forward
    return head, np.asarray(ids, dtype=np.int64), aux[0].float()


def _runtime(head, **kw):
    from vllm_specplug.eagle3.runtime import Eagle3Runtime

    return Eagle3Runtime(head, **kw)


def _ref_chain(head, ids, aux, m, steps, forced=None):
    """chain() after the first ``m`` verified tokens (state rows 0..m-2)."""
    t = torch.as_tensor(ids[: m - 1])
    return head.chain(t, aux[: m - 1], int(ids[m - 1]), steps, forced=forced)


def _path_nodes(tree, node):
    """Node indices from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def _path_tokens(tree, node):
    return [tree.tokens[j] for j in _path_nodes(tree, node)]


def _ref_score(head, ids, aux, m, path):
    """Cumulative log-prob of a drafted path, from chain(forced=path)."""
    _, outs = _ref_chain(head, ids, aux, m, len(path), forced=path[:-1])
    total = 0.0
    with torch.no_grad():
        for s, t in enumerate(path):
            logp = torch.log_softmax(head.logits(outs[s][None]).float(), -1)[0]
            total += float(logp[int(head.target_to_draft[t])])
    return total


def test_topk1_path_is_the_chain(setup):
    head, ids, aux = setup
    for m in (20, len(ids)):
        rt = _runtime(head)
        rt.extend([("a", 0, ids[:m], aux[: m - 1])])
        tree = rt.draft(["a"], [6], depth=6, topk=1)[0]
        drafts, _ = _ref_chain(head, ids, aux, m, 6)
        assert tree.is_chain() and tree.tokens == drafts
        assert tree.sources == ["eagle3"] * 6


def test_incremental_state_equals_recompute(setup):
    """Prefill in two chunks, then steps of random accepted lengths: the
    state after each equals the head run over the whole prefix."""
    head, ids, aux = setup
    rng = np.random.default_rng(0)
    rt = _runtime(head)
    pos = 0
    steps = [23, 18] + list(rng.integers(1, 6, size=30))
    for n in steps:
        if pos + n + 1 > len(ids):
            break
        rt.extend([("a", pos, ids[: pos + n + 1], aux[pos: pos + n])])
        pos += n
        st = rt.states["a"]
        assert st.n == pos
        _, outs = _ref_chain(head, ids, aux, pos + 1, 1)
        torch.testing.assert_close(st.out, outs[0], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        _, k, v = head._qkv(torch.as_tensor(ids[1: pos + 1]), head.fc(aux[:pos]),
                            torch.arange(pos))
    st = rt.states["a"]
    torch.testing.assert_close(st.k[:pos], k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st.v[:pos], v, atol=1e-4, rtol=1e-4)
    drafts, _ = _ref_chain(head, ids, aux, pos + 1, 5)
    assert rt.draft(["a"], [5], depth=5, topk=1)[0].tokens == drafts


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_every_node_matches_a_forced_path_recompute(setup, mode):
    """Two requests of different lengths drafted in one batch: every node's
    score is the cumulative log-prob chain(forced=its path) gives."""
    head, ids, aux = setup
    rt = _runtime(head)
    lens = {"a": 30, "b": len(ids) - 3}
    rt.extend([(r, 0, ids[:m], aux[: m - 1]) for r, m in lens.items()])
    template = TreeTemplate.from_spec("4,3,3,2", k=4) if mode == "static" else None
    trees = rt.draft(list(lens), [14, 9], depth=4, topk=3, template=template)
    for (r, m), tree, budget in zip(lens.items(), trees, (14, 9)):
        assert 0 < len(tree) <= budget
        tree.validate()
        assert len({(p, t) for p, t in zip(tree.parents, tree.tokens)}) == len(tree)
        for node in range(len(tree)):
            path = _path_tokens(tree, node)
            assert tree.scores[node] == pytest.approx(_ref_score(head, ids, aux, m, path),
                                                      abs=2e-3)
        # best path first: the first path follows the best-scored child
        children = tree.children()
        cur = -1
        for node in _path_nodes(tree, len(tree.first_path()) - 1):
            sib = children[cur + 1]
            assert node == sib[0] and tree.scores[node] == max(tree.scores[s] for s in sib)
            cur = node
        assert len(tree) == min(budget, len(template or range(budget)))
        assert not tree.is_chain()


def test_dynamic_tree_keeps_the_best_scored_nodes(setup):
    """With topk wide enough, the kept set's worst node scores no lower than
    any dropped candidate that was in reach (all depth-1 children)."""
    head, ids, aux = setup
    rt = _runtime(head)
    rt.extend([("a", 0, ids, aux[:-1])])
    tree = rt.draft(["a"], [10], depth=3, topk=10)[0]
    _, outs = _ref_chain(head, ids, aux, len(ids), 1)
    with torch.no_grad():
        logp = torch.log_softmax(head.logits(outs[0][None]).float(), -1)[0]
    top = logp.topk(10).values
    worst = min(tree.scores)
    kept_d1 = sum(1 for p in tree.parents if p < 0)
    # every depth-1 candidate better than the worst kept node is kept
    assert kept_d1 >= int((top > worst + 1e-6).sum())


def _eagle2_paths(head, ids, aux, m, budget, depth, topk):
    """EAGLE-2's tree by brute force, from ``chain(forced=path)`` per
    frontier node: every frontier node's ``topk`` children, the level's best
    ``topk`` as the next frontier, then the best ``budget`` candidates
    (stable: ties to the earlier). Returns the kept paths and the gap
    between the last kept score and the best one left out."""
    cands, frontier = [], [((), 0.0)]
    for _ in range(depth):
        level = []
        for path, score in frontier:
            _, outs = _ref_chain(head, ids, aux, m, len(path) + 1, forced=list(path))
            with torch.no_grad():
                logp = torch.log_softmax(head.logits(outs[len(path)][None]).float(), -1)[0]
            vals, draft_ids = logp.topk(topk)
            level += [(path + (int(d + head.d2t[d]),), score + float(v))
                      for v, d in zip(vals, draft_ids)]
        cands += level
        frontier = sorted(level, key=lambda c: -c[1])[:topk]
    ranked = sorted(cands, key=lambda c: -c[1])
    kept = {p for p, _ in ranked[:budget]}
    assert all(p[:-1] in kept for p in kept if len(p) > 1)  # a child never outscores its parent
    return kept, ranked[budget - 1][1] - ranked[budget][1]


@pytest.mark.parametrize("budget, skips", [(3, True), (6, True), (10, False)])
def test_dynamic_tree_is_eagle2s_tree_while_skipping_useless_rows(setup, budget, skips):
    """The frontier nodes that score no better than a request's
    ``budget``-th candidate are not expanded (their subtrees cannot enter
    the tree): the trees are still EAGLE-2's, built by brute force, and
    with a budget below the frontier's reach the head ran fewer rows than
    the full frontier's."""
    head, ids, aux = setup
    depth, topk, checked, rows, full_rows = 4, 4, 0, 0, 0
    for m in (30, 45, 60, len(ids)):
        rt = _runtime(head)
        rt.extend([("a", 0, ids[:m], aux[: m - 1])])
        tree = rt.draft(["a"], [budget], depth=depth, topk=topk)[0]
        want, gap = _eagle2_paths(head, ids, aux, m, budget, depth, topk)
        if gap < 1e-3:
            continue  # a near tie at the cut: float rounding may pick either
        checked += 1
        assert {tuple(_path_tokens(tree, n)) for n in range(len(tree))} == want
        rows += rt.stats.head_rows
        full_rows += rt.stats.head_passes * topk
    assert checked >= 3
    assert rows < full_rows if skips else rows <= full_rows


def test_the_int8_screen_ranks_as_the_float32_head(setup):
    """The screened LM head's best tokens are the float32 head's
    (``log_softmax(lm_head(norm(x)))``, computed here from the head's own
    modules), with log-probabilities within a few hundredths of a nat."""
    from vllm_specplug.eagle3.screen import ScreenedLogits

    head, ids, aux = setup
    outs = []
    for m in range(8, len(ids), 3):
        outs += list(_ref_chain(head, ids, aux, m, 3)[1])
    x = torch.stack(outs)
    with torch.no_grad():
        want_lp, want_ids = torch.log_softmax(head.lm_head(head.norm(x)), -1).topk(10, -1)
    got_lp, got_ids = ScreenedLogits.build(head.lm_head, head.norm).top(x, 10)
    assert len(x) > 60
    assert torch.equal(got_ids, want_ids)
    err = (got_lp - want_lp).abs()
    assert float(err.max()) < 0.05 and float(err.mean()) < 0.01


def test_a_screened_runtime_drafts_the_float32_heads_trees(setup):
    """With the screen on, each node's score is its path's float32
    log-probability (forced-path recompute) within the screen's error, and
    the best path is the float32 runtime's."""
    head, ids, aux = setup
    for m in (30, len(ids)):
        trees = []
        for screen in (False, True):
            rt = _runtime(head, screen_lm_head=screen)
            assert (rt.screen is not None) == screen
            rt.extend([("a", 0, ids[:m], aux[: m - 1])])
            trees.append(rt.draft(["a"], [8], depth=4, topk=4)[0])
        plain, screened = trees
        assert screened.first_path().tokens == plain.first_path().tokens
        for node in range(len(screened)):
            path = _path_tokens(screened, node)
            assert screened.scores[node] == pytest.approx(
                _ref_score(head, ids, aux, m, path), abs=0.05)


def test_no_screen_for_a_head_that_is_not_float32(setup):
    from vllm_specplug.eagle3.screen import ScreenedLogits

    head, _, _ = setup
    lm_head = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    assert ScreenedLogits.build(lm_head, head.norm) is None


def test_depth_hook_stops_expansion(setup):
    head, ids, aux = setup
    rt = _runtime(head)
    rt.extend([("a", 0, ids, aux[:-1]), ("b", 0, ids[:40], aux[:39])])
    seen = []

    def hook(depth, frontier_logp):
        seen.append((depth, frontier_logp.shape))
        return torch.tensor([depth < 2, True])

    a, b = rt.draft(["a", "b"], [30, 30], depth=5, topk=3, hook=hook)
    assert [d for d, _ in seen] == [1, 2, 3, 4]
    assert max(a.depths()) == 2 and max(b.depths()) == 5
    # one batched pass per expanded depth (2..5) whoever is still alive;
    # rows: both requests' 3 frontier rows at depth 2, then only b's
    assert rt.stats.head_passes == 4
    assert rt.stats.head_rows == 2 * 3 + 3 * 3


def test_prefix_store_fills_cached_blocks(setup):
    """A request whose first 32 positions come from vLLM's prefix cache gets
    them from the store (equal to recompute); an unknown prefix is refused,
    never drafted from a shorter state."""
    head, ids, aux = setup
    rt = _runtime(head)
    m = len(ids)
    rt.bind("a", "public")  # the store serves requests of one tenant
    rt.extend([("a", 0, ids, aux[:-1])])
    rt.remove("a")
    rt.add("b")
    rt.bind("b", "public")
    rt.extend([("b", 32, ids, aux[32:-1])])
    assert rt.ready("b", m) and rt.stats.store_hits == 1
    drafts, _ = _ref_chain(head, ids, aux, m, 4)
    assert rt.draft(["b"], [4], depth=4, topk=1)[0].tokens == drafts
    other = ids.copy()
    other[5] = (other[5] + 1) % 1000
    rt.add("c")
    rt.bind("c", "public")
    rt.extend([("c", 32, other, aux[32:-1])])
    assert not rt.ready("c", m) and rt.stats.store_misses == 1
    assert rt.draft(["c"], [4], depth=4, topk=1) == [None]



def test_a_prefix_shared_up_to_a_block_end_is_served_as_a_near_hit(setup):
    """Two requests that share exactly 32 tokens and part at the 33rd: the
    second's cached blocks come from the first's, the last one stored under
    the first's next token (its position 31 read that token). The request
    drafts (not refused); rows 0..30 equal a recompute; its own approximate
    block is never stored under its own next token; a longer shared prefix
    is an exact hit."""
    from vllm_specplug.eagle3.runtime import BLOCK

    head, ids, aux = setup
    rt = _runtime(head)
    m = len(ids)
    rt.bind("a", "public")
    rt.extend([("a", 0, ids, aux[:-1])])
    other = ids.copy()
    other[32] = (other[32] + 1) % 1000  # parts right after the second block
    rt.add("b")
    rt.bind("b", "public")
    rt.extend([("b", 32, other, aux[32:-1])])
    assert rt.ready("b", m) and rt.stats.store_hits == 1 and rt.stats.store_near_hits == 1
    assert rt.draft(["b"], [4], depth=4, topk=2)[0] is not None
    a, b = rt.states["a"], rt.states["b"]
    torch.testing.assert_close(b.k[:31], a.k[:31], rtol=0, atol=0)
    key = rt._block_key(b, 1, other)
    assert key[1] == other[32] and key not in rt.store  # never stored as exact
    # a request sharing 48 tokens finds its last block under its own next token
    rt.add("c")
    rt.bind("c", "public")
    rt.extend([("c", 2 * BLOCK, ids, aux[2 * BLOCK:-1])])
    assert rt.stats.store_hits == 2 and rt.stats.store_near_hits == 1

def test_warm_up_leaves_nothing_behind_but_a_level_time(setup):
    """``warm_up`` drafts from a throw-away state before serving: afterwards
    no state, no prefix-store block and no counter remain, and on CPU the
    drafting level's time is seeded (from the second, warm draft). The
    runtime then drafts exactly what a fresh runtime drafts."""
    head, ids, aux = setup
    rt = _runtime(head)
    rt.warm_up(depth=4, topk=4)
    assert rt.states == {} and len(rt.store) == 0
    assert rt.stats.draft_calls == 0 and rt.stats.head_passes == 0
    assert rt.stats.extended_rows == 0
    assert rt.level_seconds is not None and 0 < rt.level_seconds < 1.0
    fresh = _runtime(head)
    trees = []
    for r in (rt, fresh):
        r.add("a")
        r.extend([("a", 0, ids, aux[: len(ids) - 1])])
        trees.append(r.draft(["a"], [12], depth=4, topk=4)[0])
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents


def test_one_slow_level_cannot_price_every_later_level_out(setup):
    """A drafting level measured far slower than usual (a new shape's first
    call, the OS taking a core) moves the level-time estimate by at most
    ``LEVEL_JUMP`` times: uncapped, one 343 ms level would leave the
    estimate so high that the cost-aware depth stop cut every later tree
    to one level, and no later level would run to correct it."""
    from vllm_specplug.eagle3.runtime import LEVEL_JUMP

    head, _, _ = setup
    rt = _runtime(head)
    rt._observe_level(0.004)
    assert rt.level_seconds == pytest.approx(0.004)  # the first sample seeds it
    rt._observe_level(0.343)
    assert rt.level_seconds <= 0.004 + 0.2 * (LEVEL_JUMP - 1) * 0.004 + 1e-12
    for _ in range(30):
        rt._observe_level(0.004)
    assert rt.level_seconds == pytest.approx(0.004, rel=0.01)
    rt._observe_level(0.002)  # faster levels count in full
    assert rt.level_seconds == pytest.approx(0.004 + 0.2 * (0.002 - 0.004), rel=0.01)
