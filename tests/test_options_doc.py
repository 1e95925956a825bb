"""``docs/options.md`` is what ``specplug methods --markdown`` prints now: an
option added, renamed or re-documented in a method's config must reach it."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def test_committed_options_doc_matches_the_command():
    from vllm_specplug.cli.methods import markdown_document

    assert DOC.read_text(encoding="utf-8") == markdown_document(), (
        "docs/options.md is out of date: regenerate it with "
        "`specplug methods --markdown > docs/options.md`")


def test_every_method_and_option_is_in_it():
    from vllm_specplug import registry
    from vllm_specplug.cli.methods import method_options

    text = DOC.read_text(encoding="utf-8")
    # the shipped methods only: other tests register methods of their own
    assert set(registry.SHIPPED) <= set(registry.names())
    for name in registry.SHIPPED:
        assert f"## `{name}`" in text
        for option, *_ in method_options(name):
            assert f"| `{option}` |" in text, (name, option)
