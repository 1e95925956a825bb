"""READER's self-repetition metric (READER paper, section 4.1).

The paper's definition, verbatim: given a tokenized input (prompt) and a
pre-generated response,

1. place a pointer at the start of the response;
2. find the longest substring beginning at the pointer that also appears in
   the input or in the already-processed prefix of the response;
3. if no continuation is found (length zero), advance the pointer by one
   token; otherwise advance it by the continuation length.

The metric is the total number of response tokens divided by the number of
pointer advances: the mean accepted length of speculative decoding with an
infinite draft tree indexing all previously seen history.

Reading of step 2 used here (the literal one): the match must occur
entirely inside the input, or entirely inside ``response[:pointer]`` (the
already-processed prefix; a match may not run past the pointer, and it may
not straddle the input/response boundary). "Without the prompt" passes an
empty input, so only the response's own history counts. READER's third
ceiling ("with the datastore") also lets a match lie wholly inside one
document of the long-term store (its tokens as one separator-joined
sequence: the separator id occurs in no response, so no match spans two
documents).

Over a data set the metric is pooled: total response tokens / total pointer
advances (:func:`pooled`), as in the paper's per-data-set table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["advances", "self_repetition", "pooled"]


def _encode(seqs: Sequence[Sequence[int]]) -> list[str]:
    """Token ids -> strings of one code point per token (dense renumbering,
    so any vocabulary fits), so ``str.find``/``in`` do aligned token search."""
    ids: dict[int, str] = {}
    out = []
    for s in seqs:
        chars = []
        for t in s:
            c = ids.get(t)
            if c is None:
                n = len(ids)
                # Skip the surrogate block; code points are otherwise free.
                cp = n if n < 0xD800 else n + 0x800
                c = ids[t] = chr(cp)
            chars.append(c)
        out.append("".join(chars))
    return out


def advances(prompt: Sequence[int], response: Sequence[int],
             store: Sequence[int] = ()) -> int:
    """Number of pointer advances of the metric over ``response`` (matches
    also inside ``store``, a datastore's separator-joined tokens, if given)."""
    inp, resp, ext = _encode([list(prompt), list(response), list(store)])
    n = len(resp)
    p = 0
    steps = 0
    while p < n:
        hist = resp[:p]
        # Longest L with resp[p:p+L] in inp or in hist. Membership is
        # monotone in L (a prefix of a match is a match): grow it.
        length = 0
        while p + length < n:
            cand = resp[p : p + length + 1]
            if cand in inp or cand in hist or cand in ext:
                length += 1
            else:
                break
        p += length if length > 0 else 1
        steps += 1
    return steps


def self_repetition(prompt: Sequence[int], response: Sequence[int]) -> float | None:
    """The metric for one (prompt, response); ``None`` for an empty response."""
    if not response:
        return None
    return len(response) / advances(prompt, response)


def pooled(pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
           store: Sequence[int] | None = None) -> dict:
    """Pooled metric over ``(prompt, response)`` pairs, with and without the
    prompt: ``{"with_prompt", "without_prompt", "response_tokens",
    "advances_with_prompt", "advances_without_prompt", "num_outputs"}``, and
    with a ``store`` also ``"with_datastore"`` (prompt + history + store)."""
    store = None if store is None else [int(t) for t in store]
    tokens = adv_with = adv_without = adv_store = count = 0
    for prompt, response in pairs:
        if not response:
            continue
        count += 1
        tokens += len(response)
        adv_with += advances(prompt, response)
        adv_without += advances((), response)
        if store is not None:
            adv_store += advances(prompt, response, store)
    out = {
        "with_prompt": tokens / adv_with if adv_with else None,
        "without_prompt": tokens / adv_without if adv_without else None,
        "response_tokens": tokens,
        "advances_with_prompt": adv_with,
        "advances_without_prompt": adv_without,
        "num_outputs": count,
    }
    if store is not None:
        out["with_datastore"] = tokens / adv_store if adv_store else None
    return out
