"""Tenants: the keyed hash of ``cache_salt``, the engine-core hook that tags
every request (and overwrites a forged tag), the worker's reading of the
tag, and the start-up refusal of a method that would share outputs across
tenants."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vllm_specplug import registry, tenancy
from vllm_specplug.config import ADDITIONAL_CONFIG_KEY, MethodConfig, SpecplugConfigError
from vllm_specplug.engine.interface import Proposer
from vllm_specplug.tenancy import PUBLIC, TENANT_KEY, request_tenant, tenant_of


def test_same_salt_same_tenant_other_salt_other_tenant():
    a = tenant_of("alice", "salt")
    assert a == tenant_of("alice", "salt")
    assert a.startswith("t:") and len(a) == 2 + 32
    assert a != tenant_of("bob", "salt") and a != tenant_of("alice ", "salt")
    assert "alice" not in a
    assert tenant_of(None, "salt") == PUBLIC
    # the empty salt is a salt, not the public pool
    assert tenant_of("", "salt") not in (PUBLIC, None)


def test_any_salt_string_is_accepted():
    # offline requests reach the engine without the HTTP checks on the salt
    odd = ["a/b\\c@", "\x00", "\udcff", "é" * 1000]
    ids = {tenant_of(s, "salt") for s in odd}
    assert len(ids) == len(odd)


def test_the_tenant_depends_on_the_process_key(monkeypatch):
    before = tenant_of("alice", "salt")
    monkeypatch.setattr(tenancy, "_KEY", b"\x01" * 32)
    assert tenant_of("alice", "salt") != before
    assert tenant_of(None, "salt") == PUBLIC


def test_strict_shares_nothing_and_off_shares_everything():
    for salt in ("alice", "bob", None):
        assert tenant_of(salt, "strict") is None
        assert tenant_of(salt, "off") == PUBLIC


def _core(isolation: str | None):
    """What ``preprocess_add_request`` reads of an ``EngineCore``."""
    additional = None if isolation is None else {
        ADDITIONAL_CONFIG_KEY: {"method": "suffix_tree", "options": {"isolation": isolation}}}
    return SimpleNamespace(mm_receiver_cache=None, request_block_hasher=None,
                           structured_output_manager=None,
                           vllm_config=SimpleNamespace(additional_config=additional))


def _request(salt: str | None, extra_args: dict | None):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(temperature=0.0, max_tokens=4, extra_args=extra_args)
    return EngineCoreRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=params, pooling_params=None, arrival_time=time.time(),
        lora_request=None, cache_salt=salt, data_parallel_rank=None)


def _preprocess(isolation: str | None, salt: str | None, extra_args: dict | None):
    from vllm.v1.engine.core import EngineCore

    tenancy.install_engine_core_hook()
    req, _ = EngineCore.preprocess_add_request(_core(isolation), _request(salt, extra_args))
    return req.sampling_params.extra_args


def test_register_installs_the_engine_core_hook_once():
    from vllm.v1.engine.core import EngineCore

    from vllm_specplug import plugin

    plugin.register()
    hook = EngineCore.preprocess_add_request
    assert getattr(hook, "_specplug", False)
    plugin.register()
    tenancy.install_engine_core_hook()
    assert EngineCore.preprocess_add_request is hook


def test_hook_tags_requests_and_overwrites_a_forged_tag():
    forged = {TENANT_KEY: "public", "other": 1}
    tagged = _preprocess("salt", "alice", forged)
    assert tagged == {TENANT_KEY: tenant_of("alice", "salt"), "other": 1}
    assert forged == {TENANT_KEY: "public", "other": 1}  # the caller's dict untouched
    assert _preprocess("salt", None, None) == {TENANT_KEY: PUBLIC}
    # a forged id of another tenant does not survive either
    assert _preprocess("salt", "bob", {TENANT_KEY: tenant_of("alice", "salt")}) == \
        {TENANT_KEY: tenant_of("bob", "salt")}


def test_hook_strict_and_off_values():
    assert _preprocess("strict", "alice", {TENANT_KEY: "public"}) == {TENANT_KEY: None}
    assert _preprocess("off", "alice", None) == {TENANT_KEY: PUBLIC}


def test_hook_leaves_other_engines_requests_alone():
    assert _preprocess(None, "alice", {TENANT_KEY: "x"}) == {TENANT_KEY: "x"}
    assert _preprocess(None, "alice", None) is None


def test_worker_reads_the_tag_and_fails_closed():
    from vllm import SamplingParams

    def sp(extra):
        return SamplingParams(extra_args=extra)

    assert request_tenant(sp({TENANT_KEY: "t:ab"})) == "t:ab"
    assert request_tenant(sp({TENANT_KEY: PUBLIC})) == PUBLIC
    for untagged in (sp(None), sp({}), sp({TENANT_KEY: None}), sp({TENANT_KEY: 3}), None):
        assert request_tenant(untagged) is None


class _SharedMemoryProposer(Proposer):
    """A third-party method that keeps outputs across requests, not per tenant."""

    name = "shared_memory_test"
    remembers_outputs = True
    config_cls = MethodConfig


class _TenantAwareProposer(_SharedMemoryProposer):
    name = "tenant_aware_test"
    tenant_aware = True


@pytest.fixture
def third_party(monkeypatch):
    module = __name__
    monkeypatch.setitem(registry._METHODS, _SharedMemoryProposer.name,
                        f"{module}:_SharedMemoryProposer")
    monkeypatch.setitem(registry._METHODS, _TenantAwareProposer.name,
                        f"{module}:_TenantAwareProposer")


def test_a_method_sharing_outputs_across_tenants_is_refused(third_party):
    for isolation in ("salt", "strict"):
        with pytest.raises(SpecplugConfigError, match=r"\['isolation'\].*isolation 'off'") as e:
            registry.resolve({"method": "shared_memory_test", "isolation": isolation})
        assert "\n" not in str(e.value)
    with pytest.raises(SpecplugConfigError, match="isolation"):
        registry.resolve({"method": "shared_memory_test"})  # salt by default
    assert registry.resolve({"method": "shared_memory_test", "isolation": "off"})[0] == \
        "shared_memory_test"
    assert registry.resolve({"method": "tenant_aware_test"})[1].isolation == "salt"


def test_isolation_is_validated():
    with pytest.raises(SpecplugConfigError, match=r"isolation"):
        registry.resolve({"method": "pld", "isolation": "none"})
    for mode in tenancy.ISOLATION_MODES:
        assert registry.resolve({"method": "suffix_tree", "isolation": mode})[1].isolation == mode
