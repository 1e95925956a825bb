"""Memory caps on the real engine, with small caps: `graft` (EAGLE-3 head
K/V, held rows, per-request adjacency tables under isolation ``strict``) and
`suffix_tree` (the global suffix trees' response tokens), each prompt asked
three times at once (greedy; vLLM refuses ``n > 1`` for greedy requests,
and ``n=3`` top-1 sampling is checked on its own, last). The structures are measured on the method's own
objects after every step (tensor sizes, the suffix trees' own memory
estimate): they stay at their caps, and every output equals plain greedy
decoding."""

from __future__ import annotations

import random

import pytest

from tests.conftest import engine, greedy, plain_greedy
from tests.helpers.engine_checks import flush
from tests.helpers.prompts import copy_prompts, spec_bench_prompts
from vllm_specplug.sources import suffix_cache

pytestmark = pytest.mark.engine

MIB = 1 << 20
N = 3  # samples per request (SamplingParams(n=3)): three sequences each


def _sample_n(llm, prompts: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Every sequence of each request. vLLM refuses ``n > 1`` for greedy
    requests; sampling from the top-1 token alone is greedy decoding by
    another name, so all ``N`` equal plain greedy decoding."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=N, temperature=1.0, top_k=1, max_tokens=max_tokens,
                            ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _watch(worker, measure) -> None:
    """Wrap the worker's proposer: after every step, each size ``measure``
    reports is kept at its peak (``proposer.peaks``)."""
    prop = worker.model_runner._sp_proposer
    prop.peaks = {}
    inner = prop.propose

    def propose(batch, *args, **kwargs):
        out = inner(batch, *args, **kwargs)
        for name, value in measure(prop).items():
            prop.peaks[name] = max(prop.peaks.get(name, 0), value)
        return out

    prop.propose = propose


def _peaks(worker) -> dict:
    return dict(worker.model_runner._sp_proposer.peaks)


# ------------------------------------------------------------ graft
def _head_sizes(prop) -> dict:
    """What the head state and the tables take, from the tensors themselves."""
    states = prop.runtime.states.values()
    held = [c for _, chunks, _ in prop._deferred.values() for c in chunks]
    return {"kv_bytes": sum(st.k.nbytes + st.v.nbytes for st in states),
            "kv_positions": max((st.k.shape[0] for st in states), default=0),
            "held_bytes": sum(c.nbytes for c in held),
            "tables": len(prop.adjacency.tables),
            "table_bytes": sum(t.table.nbytes for t in prop.adjacency.tables)}


REQUEST_KV = 384
GRAFT = {"method": "graft", "num_speculative_tokens": 8, "isolation": "strict",
         "max_request_kv_tokens": REQUEST_KV, "max_total_kv_mib": 2,
         "max_total_held_mib": 1, "max_request_tables": 2}
GRAFT_TOKENS = 32


def test_graft_state_stays_at_its_caps(ref_model):
    # a long prompt (449 tokens) past the per-request cap, a short one under it
    prompts = [copy_prompts(ref_model, 4, max_len=900)[3], spec_bench_prompts(ref_model, 1)[0]]
    ref = plain_greedy(ref_model, prompts, GRAFT_TOKENS)
    with engine(ref_model, GRAFT, max_model_len=1024, enable_prefix_caching=False) as llm:
        llm.collective_rpc(_watch, args=(_head_sizes,))
        outs = greedy(llm, [p for p in prompts for _ in range(N)], GRAFT_TOKENS)
        flush(llm)
        peaks = llm.collective_rpc(_peaks)[0]
        stats = llm.collective_rpc("specplug_stats")[0]
    assert outs == [r for r in ref for _ in range(N)]
    row = 2 * 3 * 64 * 4  # the reference head's K and V of one position, float32
    assert peaks["kv_bytes"] <= 2 * MIB and peaks["kv_positions"] <= REQUEST_KV
    assert peaks["kv_bytes"] >= 256 * row  # the head did hold state
    assert peaks["held_bytes"] <= 1 * MIB
    table = 49152 * 8 * 4  # vocab x adjacency_topk int32
    assert peaks["tables"] <= 3 and peaks["table_bytes"] <= 3 * table
    m = stats["method"]
    longer = sum(N for p in prompts if len(p) + GRAFT_TOKENS - 1 > REQUEST_KV)
    assert longer and m["kv_capped"] >= longer  # the long prompts stopped drafting
    assert m["tables_refused"] > 0  # six sequences, two tables
    assert stats["tree_drafts"] > 0, stats  # the short ones drafted on
    assert m["live_requests"] <= 1  # freed as requests end (the flushing one is left)


# ------------------------------------------------------------ suffix_tree
def _suffix_sizes(prop) -> dict:
    caches = prop.cache
    return {"tokens": caches.cached_tokens,
            "tree_bytes": sum(c._cache._global_tree.estimate_memory()
                              for c in caches._caches.values())}


def _tree_bytes(worker) -> int:
    return _suffix_sizes(worker.model_runner._sp_proposer)["tree_bytes"]


CACHED_TOKENS = 120
SUFFIX = {"method": "suffix_tree", "num_speculative_tokens": 8, "cost_aware": False,
          "max_spec_factor": 4.0, "min_token_prob": 0.02,
          "max_cached_tokens": CACHED_TOKENS}
SUFFIX_TOKENS = 48


@pytest.mark.skipif(not suffix_cache.available(), reason="arctic-inference is not installed")
def test_suffix_trees_stay_at_max_cached_tokens(tiny_model):
    rng = random.Random(5)
    rounds = [[[rng.randrange(3, 500) for _ in range(300)] for _ in range(2)]
              for _ in range(3)]
    plain = plain_greedy(tiny_model, [p for prompts in rounds for p in prompts],
                         SUFFIX_TOKENS)  # one plain engine for every round
    refs = [plain[2 * i:2 * i + 2] for i in range(len(rounds))]
    tree_bytes = []
    with engine(tiny_model, SUFFIX, max_model_len=1024) as llm:
        llm.collective_rpc(_watch, args=(_suffix_sizes,))
        for prompts, ref in zip(rounds, refs):
            outs = greedy(llm, [p for p in prompts for _ in range(N)], SUFFIX_TOKENS)
            assert outs == [r for r in ref for _ in range(N)]
            flush(llm)
            tree_bytes.append(llm.collective_rpc(_tree_bytes)[0])
        peaks = llm.collective_rpc(_peaks)[0]
        stats = llm.collective_rpc("specplug_stats")[0]
    # each round answers 2 x 3 x 48 = 288 tokens, more than the cap holds
    assert peaks["tokens"] <= CACHED_TOKENS and stats["method"]["evicted_for_tokens"] > 0
    assert stats["tree_drafts"] > 0, stats  # the sequences drafted and were verified
    # flat: the last round's trees are no bigger than the first's (uncapped,
    # they would hold three times its tokens)
    assert tree_bytes[-1] <= 1.25 * tree_bytes[0], tree_bytes


@pytest.mark.skipif(not suffix_cache.available(), reason="arctic-inference is not installed")
def test_n3_top1_sampling_equals_greedy_under_the_caps(tiny_model):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(2)]
    ref = plain_greedy(tiny_model, prompts, SUFFIX_TOKENS)
    with engine(tiny_model, SUFFIX, max_model_len=1024) as llm:
        assert _sample_n(llm, prompts, SUFFIX_TOKENS) == [[r] * N for r in ref]
