"""The compile-cache key sees a specplug configuration's graph, not its
options (``plugin._hash_graph_not_options``), checked on a stand-in for
vLLM's config class whose hash covers ``additional_config`` whole, as
vLLM's does. The engine-level check (a second start loads the first's
compiled model) is the slow ``test_compile_cache.py``."""

from __future__ import annotations

import json

import vllm.config

from vllm_specplug import plugin
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY, GRAPH_KEY


class _Config:
    def __init__(self, spec):
        self.additional_config = {"other": 1, ADDITIONAL_CONFIG_KEY: spec}

    def compute_hash(self):
        return json.dumps(self.additional_config, sort_keys=True)


def test_options_share_a_key_graphs_do_not(monkeypatch):
    monkeypatch.setattr(vllm.config, "VllmConfig", _Config)
    monkeypatch.setattr(_Config, "compute_hash", _Config.compute_hash)
    plugin._hash_graph_not_options()
    pld4 = _Config({"method": "pld", "options": {"k": 4}, GRAPH_KEY: []})
    recycle8 = _Config({"method": "recycle", "options": {"k": 8}, GRAPH_KEY: []})
    adapld = _Config({"method": "adapld", "options": {"k": 4}, GRAPH_KEY: [3, 29]})
    assert pld4.compute_hash() == recycle8.compute_hash()
    assert adapld.compute_hash() != pld4.compute_hash()
    # Until the runner records the graph, the whole entry is hashed (a miss,
    # never a wrong load), and the hash never changes what the config holds.
    before = _Config({"method": "pld", "options": {"k": 4}})
    other = _Config({"method": "pld", "options": {"k": 8}})
    assert before.compute_hash() != other.compute_hash()
    assert pld4.additional_config[ADDITIONAL_CONFIG_KEY]["options"] == {"k": 4}
    assert pld4.compute_hash() != _Config({"method": "pld", GRAPH_KEY: [1]}).compute_hash()
