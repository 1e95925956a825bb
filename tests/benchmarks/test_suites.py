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


def test_sharegpt_suite_is_the_held_out_head_and_training_uses_only_later_ones():
    """The `sharegpt` suite evaluates heads: its conversations come only from
    the first 10,000, and the training source `sharegpt` only from later ones,
    so the two never share a conversation."""
    from vllm_specplug.corpus import SHAREGPT_HELDOUT, sharegpt_user_turns
    from vllm_specplug.eagle3.prompts import collect_prompts

    held = list(sharegpt_user_turns(0, SHAREGPT_HELDOUT))
    assert SHAREGPT_HELDOUT == 10_000 and held and max(i for i, _, _ in held) < 10_000
    suite = suites.load("sharegpt")
    assert suite.texts == [turns[0] for _, _, turns in held]
    train = collect_prompts("sharegpt")
    idx = [int(r["id"].split("/")[1]) for r in train]
    assert len(train) > 1000 and min(idx) >= 10_000
    # the dump repeats chats and splits long ones (ID_0, ID_1): none of those
    # may reach training either
    norm = lambda t: " ".join(t.split()).lower()  # noqa: E731
    assert not {norm(r["turns"][0]) for r in train} & {norm(t) for t in suite.texts}
