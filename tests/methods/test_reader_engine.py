"""`reader` on the real engine with the reference model, its shipped EAGLE-3
head and a suffix-array store built for its tokenizer: greedy output
token-identical to plain decoding at batch 1 and 8 with prefix caching on
(and under preemption, slow), every source (``eagle3``, ``search``,
``deep``) drafting and getting tokens accepted."""

from __future__ import annotations

import json

import pytest

from tests.conftest import engine, greedy, plain_greedy
from tests.methods.sampling import OneEngine, check_sampling_on
from tests.helpers.prompts import PREAMBLE, spec_bench_prompts

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
# small head trees (the head's passes are what a CPU step costs); the
# widening and deepening paths still make up a third of the tree
SPEC = {"method": "reader", "num_speculative_tokens": 16, "cost_aware": False,
        "depth": 5, "topk": 6, "d_search": 6, "d_deep": 3}


@pytest.fixture(scope="module")
def store(tmp_path_factory, ref_model):
    """A small store of chat-style answers (not the test prompts' outputs)."""
    from vllm_specplug.datastore.suffix_array import build_sa_datastore

    root = tmp_path_factory.mktemp("reader_engine")
    corpus = root / "corpus.jsonl"
    texts = ["To solve this, let's break it down step by step.",
             "Here is a short answer. First, note that the total is the sum of the parts.",
             "def main():\n    print('hello world')\n\n\nif __name__ == '__main__':\n    main()"]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 3))
    build_sa_datastore(ref_model, str(root / "store"), [str(corpus)], progress=False)
    return str(root / "store")


@pytest.fixture(scope="module")
def baseline(ref_model):
    prompts = spec_bench_prompts(ref_model, 4) + spec_bench_prompts(ref_model, 4, PREAMBLE)
    return prompts, plain_greedy(ref_model, prompts, MAX_TOKENS)


class TestOneEngine(OneEngine):
    options = dict(enable_prefix_caching=True)

    def engine_spec(self, request) -> dict:
        return {**SPEC, "datastore": request.getfixturevalue("store")}

    def test_lossless_batch_1_and_8_with_prefix_caching(self, llm, baseline):
        prompts, ref = baseline
        assert greedy(llm, prompts[4:5], MAX_TOKENS) == ref[4:5]  # batch 1
        assert greedy(llm, prompts, MAX_TOKENS) == ref  # batch 8, cached preamble
        stats = llm.collective_rpc("specplug_stats")[0]
        m = stats["method"]
        assert m["search_paths"] > 0 and m["deep_paths"] > 0 and m["store_misses"] == 0, m
        assert stats["accepted_tokens"] > 0
        assert 1 + stats["accepted_tokens"] / stats["drafts"] > 1.5, stats

    # slow: the rule that keeps the distribution is the runner's tree sampling, checked
    # in the default suite for every source at once, the head included (auto), and
    # for the head alone where arctic-inference is missing (eagle3_tree)
    @pytest.mark.slow
    def test_sampling_keeps_target_distribution(self, ref_model, llm):
        stats = check_sampling_on(llm, SPEC, ref_model, "Count from 1 to 10.")
        assert stats["method"]["search_paths"] > 0, stats["method"]


@pytest.mark.slow
def test_lossless_under_preemption(ref_model, baseline, store):
    prompts, ref = baseline
    with engine(ref_model, {**SPEC, "datastore": store}, max_model_len=512,
                num_gpu_blocks_override=5) as llm:
        assert greedy(llm, prompts, MAX_TOKENS) == ref
        stats = llm.collective_rpc("specplug_stats")[0]
    assert stats["preempted"] > 0 and stats["accepted_tokens"] > 0
