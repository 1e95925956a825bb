"""The registry: names, and options resolved in one place."""

from __future__ import annotations

import pytest

from vllm_specplug import registry
from vllm_specplug.config import SpecplugConfigError


def test_build_config_errors_are_one_line_naming_the_key():
    with pytest.raises(SpecplugConfigError) as e:
        registry.build_config("dresd", {})
    assert str(e.value).startswith("speculative_config['datastore'] is required for method "
                                   "'dresd' (Folder of a dense datastore")
    with pytest.raises(SpecplugConfigError, match=r"\['tree_branches'\]: Input should be"):
        registry.build_config("pld", {"tree_branches": 0})
    # check_against runs only when num_speculative_tokens is known
    registry.build_config("pld", {"tree_branches": 3})
    with pytest.raises(SpecplugConfigError, match=r"\['tree_branches'\]=3 exceeds"):
        registry.build_config("pld", {"tree_branches": 3}, 2)


def test_resolve_splits_method_options_from_vllm_keys():
    method, config, vllm_keys = registry.resolve(
        {"method": "pld", "num-speculative-tokens": 4, "prompt_lookup_max": 3})
    assert method == "pld" and config.prompt_lookup_max == 3
    assert vllm_keys == {"num_speculative_tokens": 4}


def test_a_registered_class_must_carry_its_name():
    registry.register("pld_alias", "vllm_specplug.methods.pld:PLDProposer")
    try:
        with pytest.raises(ValueError, match="whose name is 'pld'"):
            registry.get("pld_alias")
    finally:
        registry._METHODS.pop("pld_alias")
    with pytest.raises(ValueError, match="vLLM method name"):
        registry.register("eagle3", "x:Y")
