"""The modeled GPU speedup: pass costs from the shipped head's tensor shapes,
checked against figures computed by hand from the two models' shapes."""

import json

import pytest

from benchmarks.studies import gpu_model
from vllm_specplug.eagle3 import shipped_head_path
from vllm_specplug.models.reference import reference_model_path

# SmolLM2-135M: 30 layers x (q 576x576 + k,v 192x576 + o 576x576 + MLP
# 3x576x1536) = 106,168,320, plus the tied LM head 49,152 x 576 = 28,311,552.
TARGET = 134_479_872
# Shipped head: one layer reading [embedding; hidden] (q 576x1152, k,v
# 192x1152, o 576x576, MLP 3x576x1536) = 4,091,904, LM head 12,288 x 576 =
# 7,077,888; fc 576 x 1728 = 995,328 on the extend pass only.
DRAFT = 4_091_904 + 7_077_888
EXTEND = DRAFT + 995_328


@pytest.fixture(scope="module")
def costs():
    cfg = json.loads(open(f"{reference_model_path()}/config.json").read())
    assert gpu_model.target_params(cfg) == TARGET
    return gpu_model.pass_costs(shipped_head_path(), cfg)


def test_pass_costs_are_the_weight_ratios(costs):
    assert costs.r_extend == pytest.approx(EXTEND / TARGET)
    assert costs.r_draft == pytest.approx(DRAFT / TARGET)


def test_speedups_for_a_tree_a_chain_and_a_headless_method(costs):
    run = {"num_speculative_tokens": 16}
    recs = [
        # a tree method: 50 further head passes over 10 engine steps
        {"method": "eagle3_tree", "suite": "s", "batch_size": 1, "status": "ok", "tau": 2.0,
         "specplug_stats": {"steps": 10, "method": {"draft_head_passes": 50,
                                                    "draft_head_rows": 300}}},
        # vLLM's chain of 4: the extend pass plus 3 more
        {"method": "eagle3@k4", "suite": "s", "batch_size": 1, "status": "ok", "tau": 1.8,
         "method_options": {"num_speculative_tokens": 4}},
        {"method": "recycle", "suite": "s", "batch_size": 1, "status": "ok", "tau": 1.5},
    ]
    out = gpu_model.rows({"run": run, "records": recs}, costs)
    tree = 1 + EXTEND / TARGET + 5 * DRAFT / TARGET  # 1.505758...
    chain = 1 + EXTEND / TARGET + 3 * DRAFT / TARGET  # 1.339636...
    assert out[0]["modeled_gpu_speedup"] == pytest.approx(2.0 / tree)
    assert out[0]["head_rows_per_step"] == 30 and out[0]["head_passes_per_step"] == 5
    assert out[1]["modeled_gpu_speedup"] == pytest.approx(1.8 / chain)
    assert out[2]["modeled_gpu_speedup"] == 1.5
    assert 1.32 < out[0]["modeled_gpu_speedup"] < 1.33  # 2 / 1.5058
