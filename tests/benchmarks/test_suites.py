"""Suite loading: splits used to keep a datastore's prompts out of its measurement."""

import pytest

from benchmarks import suites


def test_even_odd_halves_partition_the_suite():
    full = suites.load("humaneval")
    even, odd = suites.load("humaneval:even"), suites.load("humaneval:odd")
    assert even.texts == full.texts[0::2] and odd.texts == full.texts[1::2]
    assert len(even.texts) + len(odd.texts) == len(full.texts) == 164
    assert not set(even.texts) & set(odd.texts)
    assert odd.name == "humaneval:odd"


def test_unknown_suffix_is_a_clear_error():
    with pytest.raises(ValueError, match="':even' or ':odd'"):
        suites.load("gsm8k:first")
