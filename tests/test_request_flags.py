"""Per-request extension fields: the parser the front end and the workers
share (``request_flags``) and the front end's validation
(``plugin.check_request``, wrapped around vLLM's ``_validate_params``): every
bad value is a ``VLLMValidationError`` naming the field, which vLLM's server
turns into an HTTP 400 with ``param`` set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_specplug import plugin
from vllm_specplug import request_flags as flags

PLAIN = {"method": "pld", "options": {}}
RELAXED = {"method": "respec", "options": {"relaxed_lossy": True}}
OPT_IN = {"method": "respec", "options": {"relaxed_lossy": "opt_in"}}


def _params(temperature=0.0, **xa):
    return SamplingParams(temperature=temperature, max_tokens=4, extra_args=xa or None)


@pytest.mark.parametrize("value,expected", [
    (True, True), (False, False), (1, True), (0, False),
    ("true", None), ("1", None), (2, None), (-1, None), (1.0, None), (0.0, None),
    (None, None), ([1], None),
])
def test_as_bool_takes_json_booleans_only(value, expected):
    assert flags.as_bool(value) is expected


@pytest.mark.parametrize("xa,field", [
    ({"specplug_speculate": "maybe"}, "specplug_speculate"),
    ({"specplug_speculate": 2}, "specplug_speculate"),
    ({"specplug_speculate": 1.0}, "specplug_speculate"),
    ({"specplug_relaxed": "false"}, "specplug_relaxed"),
    ({"specplug_relaxed": [0]}, "specplug_relaxed"),
    ({"specplug_bogus": 1}, "specplug_bogus"),
    ({"specplug_": True}, "specplug_"),
    ({"_specplug_tenant": "x"}, "_specplug_tenant"),
    ({"_specplug": 1}, "_specplug"),
    ({"ok_key": 1, "_specplug_anything": 0}, "_specplug_anything"),
])
def test_bad_fields_name_the_field(xa, field):
    with pytest.raises(VLLMValidationError) as e:
        plugin.check_request(_params(**xa), PLAIN)
    assert e.value.parameter == field
    assert field in str(e.value)


@pytest.mark.parametrize("value", [True, False, 1, 0])
def test_boolean_values_pass(value):
    plugin.check_request(_params(specplug_speculate=value), RELAXED)
    plugin.check_request(_params(specplug_relaxed=value), RELAXED)
    plugin.check_request(_params(specplug_relaxed=value), OPT_IN)


def test_other_keys_are_left_to_vllm_and_other_plugins():
    plugin.check_request(_params(kv_transfer_params=1, my_plugin_speculate="x",
                                 SPECPLUG_SPECULATE="x"), PLAIN)


@pytest.mark.parametrize("value", [True, 1])
def test_opting_in_where_the_server_does_not_relax_is_refused(value):
    for spec in (PLAIN, {"method": "respec", "options": {"relaxed_lossy": False}}):
        with pytest.raises(VLLMValidationError) as e:
            plugin.check_request(_params(specplug_relaxed=value), spec)
        assert e.value.parameter == "specplug_relaxed"
        assert "LOSSY" in str(e.value)


@pytest.mark.parametrize("value", [False, 0])
def test_opting_out_is_fine_everywhere(value):
    plugin.check_request(_params(specplug_relaxed=value), PLAIN)
    plugin.check_request(_params(0.8, specplug_relaxed=value), RELAXED)


def test_relaxed_server_refuses_a_sampled_request_unless_it_opts_out():
    with pytest.raises(VLLMValidationError) as e:
        plugin.check_request(_params(0.8), RELAXED)
    assert e.value.parameter == "temperature" and "relaxed_lossy" in str(e.value)
    plugin.check_request(_params(0.8, specplug_relaxed=False), RELAXED)
    plugin.check_request(_params(0.8, specplug_speculate=0), RELAXED)


def test_opt_in_server_checks_only_the_requests_that_opt_in():
    plugin.check_request(_params(0.8), OPT_IN)  # not relaxed: served as asked
    plugin.check_request(_params(specplug_relaxed=1), OPT_IN)
    with pytest.raises(VLLMValidationError) as e:
        plugin.check_request(_params(0.8, specplug_relaxed=1), OPT_IN)
    assert e.value.parameter == "specplug_relaxed" and "greedy" in str(e.value)


@pytest.mark.parametrize("mode,xa,expected", [
    (False, {}, False), (False, {"specplug_relaxed": 1}, False),
    (True, {}, True), (True, {"specplug_relaxed": 0}, False),
    (True, {"specplug_relaxed": True}, True), (True, {"specplug_speculate": 0}, False),
    ("opt_in", {}, False), ("opt_in", {"specplug_relaxed": 1}, True),
    ("opt_in", {"specplug_relaxed": False}, False),
    ("opt_in", {"specplug_relaxed": 1, "specplug_speculate": False}, False),
    (None, {"specplug_relaxed": 1}, False),
])
def test_wants_relaxed(mode, xa, expected):
    assert flags.wants_relaxed(xa, mode) is expected


def test_speculates_defaults_to_true():
    assert flags.speculates(None) and flags.speculates({})
    assert flags.speculates({"specplug_speculate": 1})
    assert not flags.speculates({"specplug_speculate": 0})
    assert not flags.speculates({"specplug_speculate": False})


def test_wrapper_validates_only_specplug_engines(monkeypatch):
    from vllm.v1.engine.input_processor import InputProcessor

    seen = []
    monkeypatch.setattr(InputProcessor, "_validate_params",
                        lambda self, params, tasks: seen.append(params) or "vllm's")
    plugin._validate_specplug_requests()
    wrapped = InputProcessor._validate_params
    bad = _params(specplug_bogus=1)

    def processor(additional):
        return SimpleNamespace(vllm_config=SimpleNamespace(additional_config=additional))

    assert wrapped(processor(None), bad, ("generate",)) == "vllm's"
    assert wrapped(processor({"other": 1}), bad, ("generate",)) == "vllm's"
    with pytest.raises(VLLMValidationError) as e:
        wrapped(processor({"specplug": PLAIN}), bad, ("generate",))
    assert e.value.parameter == "specplug_bogus"
    assert wrapped(processor({"specplug": PLAIN}), _params(specplug_speculate=0),
                   ("generate",)) == "vllm's"
    assert len(seen) == 4  # vLLM's own checks ran first every time
