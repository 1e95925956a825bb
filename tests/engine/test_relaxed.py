"""ReSpec's LOSSY relaxed walk (``engine/verify.relaxed_path``) on hand-made
trees and target top-k rows: Eq. 6 (top-beta), Eq. 7 (tau nats), the
look-ahead of m strict matches, Phi attempts, and sources."""

from __future__ import annotations

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.engine.verify import RelaxedRule, relaxed_path


def _rows(*rows):
    """Each row: [(token, logp), ...] best first."""
    return [[t for t, _ in r] for r in rows], [[lp for _, lp in r] for r in rows]


# a retrieved chain 10 11 12 13; the target's argmax after the root is 9
CHAIN = DraftTree([10, 11, 12, 13], [-1, 0, 1, 2], sources=["retrieval"] * 4)
ROWS = _rows(
    [(9, -0.5), (10, -1.2), (5, -3.0)],   # after root: 10 is 2nd, 0.7 nats below
    [(11, -0.1), (7, -3.0), (5, -4.0)],   # after 10: 11 strict
    [(12, -0.2), (7, -3.0), (5, -4.0)],   # after 11: 12 strict
    [(99, -0.2), (13, -3.0), (5, -4.0)],  # after 12: 13 is 2.8 nats below
    [(1, -0.2), (2, -3.0), (5, -4.0)],
)


def rule(**kw):
    base = dict(beta=3, tau=1.0, phi=1, m=2, sources=("retrieval",))
    return RelaxedRule(**{**base, **kw})


def test_relaxed_token_accepted_with_lookahead():
    path, relaxed = relaxed_path(CHAIN, CHAIN.tokens, rule(), *ROWS)
    assert path == [0, 1, 2] and relaxed == [0]


def test_eq6_eq7_and_strict_limits():
    # tau below the gap (Eq. 7), beta excluding the token (Eq. 6): strict
    assert relaxed_path(CHAIN, CHAIN.tokens, rule(tau=0.5), *ROWS) == ([], [])
    assert relaxed_path(CHAIN, CHAIN.tokens, rule(beta=1), *ROWS) == ([], [])
    assert relaxed_path(CHAIN, CHAIN.tokens, rule(beta=1, tau=0.0), *ROWS) == ([], [])
    # look-ahead: only 2 strict matches follow node 0
    assert relaxed_path(CHAIN, CHAIN.tokens, rule(m=3), *ROWS) == ([], [])


def test_phi_attempts_and_a_second_relaxation():
    # the second mismatch (13 after 12) is 2.8 nats down: needs tau >= 2.8,
    # a second attempt, and m=0 strict followers (none left in the chain)
    r = rule(tau=3.0, phi=2, m=0)
    assert relaxed_path(CHAIN, CHAIN.tokens, r, *ROWS) == ([0, 1, 2, 3], [0, 3])
    assert relaxed_path(CHAIN, CHAIN.tokens, rule(tau=3.0, phi=1, m=0), *ROWS) == (
        [0, 1, 2], [0])


def test_model_drafted_nodes_stay_strict():
    tree = DraftTree(CHAIN.tokens, CHAIN.parents, sources=["eagle3"] * 4)
    assert relaxed_path(tree, tree.tokens, rule(), *ROWS) == ([], [])


def test_strict_child_preferred_in_a_tree():
    # root -> 10 (retrieval, relaxable) and 9 (strict): the strict one wins
    tree = DraftTree([10, 11, 12, 9], [-1, 0, 1, -1], sources=["retrieval"] * 4)
    rows = _rows([(9, -0.5), (10, -1.2)], [(11, -0.1)], [(12, -0.1)], [(3, -0.1)],
                 [(4, -0.1)])
    assert relaxed_path(tree, tree.tokens, rule(), *rows) == ([3], [])
