"""The tree sampling rule keeps the target's distribution exactly.

Runs the runner's path choice plus vLLM's real rejection sampler on
synthetic logits where siblings carry most of the mass, and compares the
emitted tokens with the target distribution by a chi-square test. A naive
rule that does not take the rejected siblings' mass out of ``p`` is shown to
fail the same test, so the test has the power to catch that bug.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_specplug.engine.tree import DraftTree
from vllm_specplug.engine.verify import child_probs, choose_paths, draft_probs_tensor

VOCAB = 6
N = 6000
# Root distribution: siblings 0, 1, 2 hold 85% of the mass.
P_ROOT = torch.tensor([0.40, 0.25, 0.20, 0.08, 0.05, 0.02])
# Distribution after each node (same for all, for a simple expected value).
P_NEXT = torch.tensor([0.10, 0.10, 0.50, 0.10, 0.10, 0.10])
TREE = DraftTree([1, 0, 2, 2], [-1, -1, -1, 1])  # node 3 = token 2 under token 0


def _sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    # What the CPU worker does at start-up: C++ stand-ins for Triton kernels.
    if hasattr(current_platform, "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    from vllm_specplug.runner.runner import apply_vllm_cpu_fixes

    apply_vllm_cpu_fixes()
    from vllm.v1.sample.sampler import Sampler

    return RejectionSampler(Sampler())


def _metadata(n: int, seed: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    gens = {i: torch.Generator().manual_seed(seed * 100003 + i) for i in range(n)}
    return SamplingMetadata(
        temperature=torch.ones(n), all_greedy=False, all_random=True,
        top_p=None, top_k=None, generators=gens, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _run(choose, seed=0, full=False):
    """First emitted token of N requests, each verifying TREE once."""
    from vllm_specplug.runner.runner import path_chain_metadata

    n_nodes = len(TREE)
    rows = torch.stack([P_ROOT] + [P_NEXT] * n_nodes)  # root + one row per node
    logits = rows.log().repeat(N, 1)
    base = np.arange(N) * (n_nodes + 1)
    drafts = [TREE.tokens] * N
    sm = _metadata(N, seed)
    probs = torch.softmax(logits, -1)
    trees = {i: TREE for i in range(N)}
    walks = child_probs(trees, drafts, list(range(N)), probs,
                        {i: int(b) for i, b in enumerate(base)}, sm.generators)
    chosen = choose(trees, drafts, base, set(), None, walks)
    meta, gather, _ = path_chain_metadata(chosen.paths, drafts, base, "cpu")
    q = draft_probs_tensor(chosen.q_rows, VOCAB, "cpu")
    out = _sampler()(meta, q, logits[gather], sm).sampled_token_ids
    return out.numpy() if full else out[:, 0].numpy()


def _pvalue(first_tokens) -> float:
    counts = np.bincount(first_tokens, minlength=VOCAB)
    return chisquare(counts, P_ROOT.numpy() * len(first_tokens)).pvalue


def test_tree_rule_keeps_target_distribution():
    assert _pvalue(_run(choose_paths)) > 1e-3


def _naive_choose(trees, drafts, base, greedy, argmax, walks):
    """Bug on purpose: the path is picked by p but verified with one-hot q, so
    the rejected siblings' mass is never taken out of p."""
    chosen = choose_paths(trees, drafts, base, greedy, argmax, walks)
    chosen.q_rows = [q[0][int(np.argmax(q[1]))] if isinstance(q, tuple) else q
                     for q in chosen.q_rows]
    return chosen


def test_naive_rule_is_caught():
    assert _pvalue(_run(_naive_choose)) < 1e-6


@pytest.mark.parametrize("seed", [1, 2])
def test_token_after_an_accepted_node(seed):
    """Where a first token was accepted, the second one must follow P_NEXT
    whether it came from the tree (token 2 under token 0) or as the bonus."""
    out = _run(choose_paths, seed, full=True)
    second = out[:, 1]
    second = second[second >= 0]
    counts = np.bincount(second, minlength=VOCAB)
    assert chisquare(counts, P_NEXT.numpy() * len(second)).pvalue > 1e-3


def test_padded_request_in_sampled_tree_batch():
    """vLLM pads a fully prefix-cached new request with ``-1`` drafts. Mixed
    into a sampled tree batch (so vLLM gets a draft-probability tensor), such
    a request must still emit its first token from ``p``: its ``q`` rows are
    zero, not a one-hot on the last vocabulary id (which would remove that
    id's mass from the residual)."""
    from vllm_specplug.runner.runner import path_chain_metadata

    n_nodes, pad = len(TREE), [-1, -1, -1]
    tree_rows = torch.stack([P_ROOT] + [P_NEXT] * n_nodes).log()
    pad_rows = torch.stack([P_ROOT] + [P_NEXT] * len(pad)).log()
    drafts, blocks, base, trees, at = [], [], [], {}, 0
    for i in range(N):
        if i % 2:
            drafts.append(pad)
            blocks.append(pad_rows)
        else:
            drafts.append(TREE.tokens)
            blocks.append(tree_rows)
            trees[i] = TREE
        base.append(at)
        at += blocks[-1].shape[0]
    logits, base = torch.cat(blocks), np.asarray(base)
    sm = _metadata(N, seed=5)
    walks = child_probs(trees, drafts, sorted(trees), torch.softmax(logits, -1),
                        {i: int(base[i]) for i in trees}, sm.generators)
    chosen = choose_paths(trees, drafts, base, set(), None, walks)
    meta, gather, _ = path_chain_metadata(chosen.paths, drafts, base, "cpu")
    q = draft_probs_tensor(chosen.q_rows, VOCAB, "cpu")
    out = _sampler()(meta, q, logits[gather], sm).sampled_token_ids
    first = out[1::2, 0].numpy()
    assert (out[1::2, 1] == -1).all()  # padding is never accepted
    assert _pvalue(first) > 1e-3


def test_negative_draft_gives_zero_q_row():
    q = draft_probs_tensor([3, -1, ([1, 2], [0.25, 0.75])], VOCAB, "cpu")
    assert q[1].abs().sum() == 0
    assert q[0, 3] == 1 and q[0].sum() == 1
    assert q[2, 1] == 0.25 and q[2, 2] == 0.75 and q[2].sum() == 1
