"""Every wrong configuration an operator can start the server with, walked
by one test: each is a one-line error naming the key or file, raised while
vLLM's engine config is built (what `vllm serve` / `specplug serve` and
`LLM()` do first), before any engine process starts. ``docs/serving.md``
lists this catalogue ("Start-up errors")."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vllm_specplug.config import SpecplugConfigError

N = {"num_speculative_tokens": 4}


def _create(model: str, spec: dict, **engine):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.plugin import register

    register()
    opts = dict(dtype="float32", max_model_len=512)
    opts.update(engine)
    return EngineArgs(model=model, speculative_config=spec, **opts).create_engine_config()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model, ref_model):
    """Real artefacts, some of them broken: a dense store built for the tiny
    model and copies of it truncated, corrupted and re-labelled with another
    tokenizer; an adjacency table of the tiny model's vocabulary; a copy of
    the tiny model with sliding-window attention."""
    from vllm_specplug.datastore.build import build_dense_datastore
    from vllm_specplug.sources.adjacency import AdjacencyTable

    root = tmp_path_factory.mktemp("startup")
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"{i} apples and {i + 1} pears, "
                                                    "then more apples and pears."})
                                for i in range(40)))
    store = str(root / "store")
    build_dense_datastore(tiny_model, store, corpus=str(corpus), n_next=5, dims=8,
                          index="brute_force", num_threads=1, progress=False)
    out = {"store": store, "empty_dir": str(root / "empty")}
    os.makedirs(out["empty_dir"])
    for name in ("truncated", "corrupt", "other_tok"):
        out[name] = str(root / name)
        shutil.copytree(store, out[name])
    with open(os.path.join(out["truncated"], "values.npy"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(store, "values.npy")) - 7)
    with open(os.path.join(out["corrupt"], "values.npy"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    man = os.path.join(out["other_tok"], "manifest.json")
    meta = json.load(open(man))
    meta["tokenizer_hash"] = "sha256:" + "0" * 64
    json.dump(meta, open(man, "w"))
    out["table_tiny"] = str(root / "tiny_table.safetensors")
    AdjacencyTable(512, 8, model_id="tiny").save(out["table_tiny"])
    out["not_a_table"] = str(root / "junk.safetensors")
    open(out["not_a_table"], "w").write("not safetensors")
    sw = root / "tiny_sliding"
    shutil.copytree(tiny_model, sw)
    cfg = json.load(open(sw / "config.json"))
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    json.dump(cfg, open(sw / "config.json", "w"))
    out["sliding_model"] = str(sw)
    return out


# (id, model: "tiny"|"ref"|files key, spec (str values "@key" are files keys),
#  engine kwargs, expected substring of the one-line error)
CATALOGUE = [
    ("unknown-option", "tiny", {"method": "pld", **N, "bogus": 1}, {},
     "unknown key 'bogus' for method 'pld'"),
    ("wrong-type", "tiny", {"method": "pld", **N, "prompt_lookup_max": "4"}, {},
     "speculative_config['prompt_lookup_max']: Input should be a valid integer"),
    ("wrong-type-bool", "tiny", {"method": "recycle", **N, "per_request_tables": "yes"}, {},
     "speculative_config['per_request_tables']: Input should be a valid boolean"),
    ("out-of-range", "tiny", {"method": "pld", **N, "prompt_lookup_max": 0}, {},
     "speculative_config['prompt_lookup_max']: Input should be greater than or equal to 1"),
    ("out-of-range-float", "tiny", {"method": "dresd", **N, "datastore": "@store",
                                    "min_similarity": 2.0}, {},
     "speculative_config['min_similarity']: Input should be less than or equal to 1"),
    ("budget-zero", "tiny", {"method": "pld", "num_speculative_tokens": 0}, {},
     "speculative_config['num_speculative_tokens']"),
    ("min-above-max", "tiny", {"method": "pld", **N, "prompt_lookup_min": 5,
                               "prompt_lookup_max": 3}, {},
     "speculative_config['prompt_lookup_min']=5 must be <="),
    ("branches-above-budget", "tiny", {"method": "pld", "num_speculative_tokens": 2,
                                       "tree_branches": 3}, {},
     "speculative_config['tree_branches']=3 exceeds num_speculative_tokens=2"),
    ("budget-above-batched-tokens", "tiny", {"method": "pld", "num_speculative_tokens": 40},
     {"max_num_batched_tokens": 32, "enable_chunked_prefill": True},
     "speculative_config['num_speculative_tokens']=40: a draft needs 41 tokens per request "
     "per step, more than max_num_batched_tokens=32"),
    ("budget-above-context", "tiny", {"method": "pld", "num_speculative_tokens": 64},
     {"max_model_len": 64}, "leaves no room in max_model_len=64"),
    ("budget-above-template", "tiny", {"method": "recycle", "num_speculative_tokens": 30,
                                       "template": "4,2"}, {},
     "speculative_config['num_speculative_tokens']=30 exceeds the"),
    ("bad-template", "tiny", {"method": "recycle", **N, "template": "8,x"}, {},
     "speculative_config['template']"),
    ("missing-table", "tiny", {"method": "recycle", **N, "table_path": "/nonexistent/t.st"}, {},
     "speculative_config['table_path']: no such file '/nonexistent/t.st'"),
    ("corrupt-table", "tiny", {"method": "recycle", **N, "table_path": "@not_a_table"}, {},
     "speculative_config['table_path']: adjacency table"),
    ("table-other-tokenizer", "ref", {"method": "recycle", **N, "table_path": "@table_tiny"},
     {}, "was built for a vocabulary of 512 tokens"),
    ("graft-table-other-tokenizer", "ref", {"method": "graft", **N, "table_path": "@table_tiny"},
     {}, "speculative_config['table_path']: adjacency table"),
    ("graft-thresholds-out-of-range", "ref", {"method": "graft", **N,
                                              "thresholds": [0.1, 0.2, 1.5]}, {},
     "speculative_config['thresholds']"),
    ("store-missing", "tiny", {"method": "dresd", **N, "datastore": "/nonexistent/store"}, {},
     "speculative_config['datastore']: dense datastore /nonexistent/store: no such directory"),
    ("store-not-a-store", "tiny", {"method": "dresd", **N, "datastore": "@empty_dir"}, {},
     "missing file 'manifest.json'"),
    ("store-truncated", "tiny", {"method": "dresd", **N, "datastore": "@truncated"}, {},
     "corrupted file 'values.npy' (size"),
    ("store-corrupt", "tiny", {"method": "dresd", **N, "datastore": "@corrupt"}, {},
     "corrupted file 'values.npy' (sha256 mismatch)"),
    ("store-other-tokenizer", "tiny", {"method": "dresd", **N, "datastore": "@other_tok"}, {},
     "tokenizer mismatch"),
    ("store-other-target", "ref", {"method": "dresd", **N, "datastore": "@store"}, {},
     "hidden size mismatch: built for 256"),
    ("dresd-drafts-above-candidates", "tiny", {"method": "dresd", **N, "datastore": "@store",
                                               "num_candidates": 2}, {},
     "speculative_config['greedy_num_drafts']=3 exceeds num_candidates=2"),
    ("adapld-layer-out-of-range", "tiny", {"method": "adapld", "num_speculative_tokens": 10,
                                           "hidden_layer": 7}, {},
     "speculative_config['hidden_layer']=7 is out of range: the target has 2 decoder layers"),
    ("adapld-head-above-half", "tiny", {"method": "adapld", "num_speculative_tokens": 10,
                                        "memory_max_positions": 100,
                                        "memory_head_positions": 80}, {},
     "speculative_config['memory_head_positions']=80 must be <="),
    ("eagle3-head-other-target", "tiny", {"method": "eagle3", **N, "model": "@shipped_head"},
     {}, "speculative_config['model']: EAGLE-3 head"),
    ("eagle3-no-head-for-target", "tiny", {"method": "eagle3", **N}, {},
     "speculative_config method 'eagle3' needs 'model'"),
    ("kv-cache-dtype", "tiny", {"method": "pld", **N}, {"kv_cache_dtype": "fp8"},
     "kv_cache_dtype='fp8': specplug tree verification needs kv_cache_dtype='auto'"),
    ("sliding-window", "sliding_model", {"method": "pld", **N}, {},
     "model config 'sliding_window': specplug tree verification does not support"),
    ("foreign-worker", "tiny", {"method": "pld", **N}, {"worker_cls": "my.Worker"},
     "specplug method 'pld' needs its own worker; drop --worker-cls"),
]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_startup_error_catalogue(case, files, tiny_model, ref_model):
    from vllm_specplug.eagle3 import shipped_head_path

    _, model, spec, engine, message = case
    paths = {**files, "tiny": tiny_model, "ref": ref_model, "shipped_head": shipped_head_path()}
    spec = {k: paths[v[1:]] if isinstance(v, str) and v.startswith("@") else v
            for k, v in spec.items()}
    with pytest.raises(ValueError) as err:  # SpecplugConfigError is a ValueError
        _create(paths[model], spec, **engine)
    text = str(err.value)
    assert message in text, text
    assert "\n" not in text, text


def test_bf16_on_amx_cpu_is_refused(tiny_model, monkeypatch):
    """bf16 with AMX gives vLLM's CPU attention a packed KV layout the tree
    reader does not know. The CPU feature probe is the one thing replaced
    here, so the test runs on any CPU (the check's logic and message are
    real)."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with pytest.raises(SpecplugConfigError, match="dtype='bfloat16': on this CPU"):
        _create(tiny_model, {"method": "pld", **N}, dtype="bfloat16")


def test_good_configuration_passes_the_same_checks(files, tiny_model):
    cfg = _create(tiny_model, {"method": "dresd", **N, "datastore": files["store"]})
    assert cfg.additional_config["specplug"]["method"] == "dresd"
