"""`specplug datastore build-dense/build-sa --suites`: the target's own
answers to a prompt suite as a store, its prompt list beside it, and never
a held-out suite."""

from __future__ import annotations

import json

import pytest

from vllm_specplug import suites
from vllm_specplug.datastore import prompt_list

PROMPTS = ["Name three colours.", "What is two and two?", "Say hello in French."]


def _cli(*argv: str) -> int:
    from vllm_specplug.cli import main

    return main(["datastore", *argv])


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


def _measured(name: str, used: list[str]) -> suites.Suite:
    s = suites.Suite(name, "mem", used)
    s.used_texts = used
    return s


@pytest.mark.parametrize("command", ["build-dense", "build-sa"])
@pytest.mark.parametrize("held_out", ["specbench:mt_bench", "sharegpt"])
def test_held_out_suites_are_refused_before_any_model_loads(tmp_path, capsys, command,
                                                             held_out):
    out = tmp_path / "store"
    rc = _cli(command, "--model", str(tmp_path / "no-such-model"), "--out", str(out),
              "--suites", f"humaneval:even,{held_out}")
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "must not hold the answers to" in err and held_out in err
    assert "humaneval:even" not in err.split("to", 1)[1]  # only the held-out one is named
    assert not out.exists()


def test_a_store_needs_its_documents_named_once(tmp_path, capsys, prompt_file):
    out = str(tmp_path / "store")
    assert _cli("build-sa", "--model", "m", "--out", out) == 2
    assert "--corpus and/or --suites" in capsys.readouterr().err
    assert _cli("build-dense", "--model", "m", "--out", out, "--suites", prompt_file,
                "--in-distribution", prompt_file) == 2
    assert "give one" in capsys.readouterr().err


def test_a_full_out_folder_is_refused_before_answering(tmp_path, capsys, prompt_file):
    out = tmp_path / "store"
    out.mkdir()
    (out / "old").write_text("x")
    assert _cli("build-sa", "--model", "m", "--out", str(out), "--suites", prompt_file) == 1
    assert "is not empty (use --overwrite)" in capsys.readouterr().err


def test_dense_store_of_a_suites_answers(tmp_path, capsys, tiny_model, prompt_file):
    out = str(tmp_path / "store")
    rc = _cli("build-dense", "--model", tiny_model, "--out", out, "--suites", prompt_file,
              "--skip", "1", "--max-new-tokens", "4", "--n-next", "4", "--dims", "8",
              "--threads", "1", "--no-progress")
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["in_distribution_responses"] == 2  # the first one skipped
    # the prompt list holds the answered prompts, not the skipped one
    assert prompt_list.overlap(out, [_measured("mine", PROMPTS[:1])]) == {}
    assert prompt_list.overlap(out, [_measured("mine", PROMPTS)]) == {"mine": 2}


@pytest.mark.engine
def test_suffix_array_store_of_a_suites_answers(tmp_path, tiny_model, prompt_file):
    out = str(tmp_path / "store")
    rc = _cli("build-sa", "--model", tiny_model, "--out", out, "--suites", prompt_file,
              "--limit", "2", "--max-new-tokens", "8", "--no-progress")
    assert rc == 0
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["num_documents"] == 2  # vLLM logs to stdout too: read the manifest
    answers = (tmp_path / "store.answers.jsonl").read_text().splitlines()
    assert len(answers) == 2 and all("text" in json.loads(a) for a in answers)
    assert prompt_list.overlap(out, [_measured("mine", PROMPTS)]) == {"mine": 2}
