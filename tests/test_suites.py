"""Prompt suites: splits that keep a datastore's prompts out of its measurement,
and the held-out suites no store or calibration may use."""

import pytest

from vllm_specplug import suites


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


def test_tokenize_records_the_texts_it_used(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    s = suites.Suite("x", "mem", ["short", "x" * 5000, "also short", "third"])
    suites.tokenize(s, tok, limit=2, max_prompt_len=200)
    assert s.used_texts == ["short", "also short"]



@pytest.mark.parametrize("name", ["specbench", "specbench:mt_bench", "specbench:math_reasoning",
                                  "specbench:writing", "mtbench", "gsm8k", "gsm8k:even",
                                  "sharegpt", "sharegpt:odd", "humaneval", "humaneval:odd",
                                  "specbench:rag", "specbench:summarization", "code_edit",
                                  "doc_qa:even"])
def test_held_out_suites_are_refused(name):
    assert suites.held_out_reason(name)
    with pytest.raises(ValueError, match=name):
        suites.check_not_held_out(["humaneval:even", name], "may not use")


@pytest.mark.parametrize("name", ["humaneval:even", "specbench:qa", "specbench:translation",
                                  "/data/my_prompts.jsonl"])
def test_calibration_suites_are_allowed(name):
    assert suites.held_out_reason(name) is None
    suites.check_not_held_out([name], "may not use")


def test_a_mixed_suite_interleaves_its_parts_one_by_one():
    qa, rag, odd = (suites.load(n) for n in ("specbench:qa", "specbench:rag", "humaneval:odd"))
    mixed = suites.load("specbench:qa+specbench:rag+humaneval:odd")
    assert mixed.texts[:6] == [qa.texts[0], rag.texts[0], odd.texts[0],
                               qa.texts[1], rag.texts[1], odd.texts[1]]
    assert len(mixed.texts) == len(qa.texts) + len(rag.texts) + len(odd.texts)
    # a part that runs out leaves the others' turns
    short = suites.load("specbench:qa+humaneval:odd")
    assert short.texts[-1] == odd.texts[-1] and short.texts.count(odd.texts[-1]) == 1
    assert suites.held_out_reason("specbench:qa+humaneval:odd").startswith("humaneval:odd")
    assert suites.held_out_reason("specbench:qa+specbench:translation") is None
    with pytest.raises(ValueError, match="two or more"):
        suites.load("specbench:qa+")
    assert suites.load(" specbench:qa + humaneval:odd ").texts == short.texts


def test_a_prompt_file_with_a_plus_in_its_name_is_a_file(tmp_path):
    path = tmp_path / "c++" / "q+a.jsonl"
    path.parent.mkdir()
    path.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert suites.load(str(path)).texts == ["one", "two"]
    assert suites.held_out_reason(str(path)) is None


def test_code_edit_and_doc_qa_are_built_from_this_install():
    import ast

    edits = suites.load("code_edit").texts
    assert len(edits) >= 60
    # each prompt holds a whole function that parses, from a module named
    # in it, and one edit to make; the first prompts come from different modules
    for text in edits[:20]:
        source = text.split("```python\n")[1].split("\n```")[0]
        (fn,) = ast.parse(source).body
        assert isinstance(fn, ast.FunctionDef) and "Return the complete function." in text
    assert len({t.split("`")[1] for t in edits[:8]}) == 8
    pages = suites.load("doc_qa").texts
    assert len(pages) >= 60 and len(set(pages)) == len(pages)
    first = pages[:8]  # eight different packages' pages, each with a question
    assert len({t.rsplit("\n\n---\n\n", 1)[0] for t in first}) == 8
    assert all(2000 <= len(t.rsplit("\n\n---\n\n", 1)[0]) <= 4000 for t in pages)
    assert suites.load("code_edit").texts == edits  # deterministic
