"""Prompt lookup: drafts copied from where the text's last few tokens occurred before."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lookup(
    tokens: Sequence[int], k: int, min_n: int, max_n: int, corpus: Sequence[int] | None = None
) -> list[int]:
    """Up to `k` tokens that followed the last occurrence of the longest suffix n-gram of `tokens`
    (min_n <= n <= max_n, vLLM's prompt_lookup_min/max) in `corpus` (default: `tokens` before its
    own suffix); [] when none occurs.

    A match of n tokens is also one of every shorter n at the same place, so the longest n that
    matches anywhere wins, and among its matches the last one (the most recent text). In its own
    text, k tokens are always proposed: what follows the match, repeated with its period where
    it runs into the end (vLLM stops there).
    """
    size = len(tokens)
    if k <= 0 or size < min_n:
        return []
    own = corpus is None
    text = np.asarray(tokens if own else corpus, dtype=np.int64)
    tail = np.asarray(tokens[-max_n:], dtype=np.int64)
    # NOTE: in its own text a match must end before the last token, so something follows it
    searchable = text[:-1] if own else text
    ends = np.flatnonzero(searchable == tail[-1])
    if ends.size == 0:
        return []
    alive = np.ones(ends.size, dtype=bool)
    best = None
    for n in range(1, min(max_n, size) + 1):
        if n > 1:
            alive &= ends >= n - 1
            back = np.where(alive, ends - (n - 1), 0)
            alive &= text[back] == tail[-n]
        if not alive.any():
            break
        if n >= min_n:
            best = ends[alive]
    if best is None:
        return []
    start = int(best[-1]) + 1
    if not own:
        return list(corpus[start : start + k])
    # NOTE: a match near the end has fewer than k tokens after it; the text then repeats with the
    # match's period (a row of a grid, a run of one token), so the drafts continue with it
    drafts: list[int] = []
    for at in range(start, start + k):
        drafts.append(tokens[at] if at < size else drafts[at - size])
    return drafts


def nearest_lookup(
    output: Sequence[int], prediction: Sequence[int], k: int, max_n: int
) -> list[int]:
    """Drafts from a client's predicted output: its continuation while the output still follows
    it, else what follows the longest suffix of the output found in it, taking the occurrence
    nearest the output's own length (an answer that edits a few cells of the prediction stays
    aligned with it)."""
    done = len(output)
    if k <= 0 or not prediction:
        return []
    if list(prediction[:done]) == list(output):
        return list(prediction[done : done + k])
    text = np.asarray(prediction, dtype=np.int64)
    tail = np.asarray(output[-max_n:], dtype=np.int64)
    ends = np.flatnonzero(text == tail[-1])
    if ends.size == 0:
        return []
    alive = np.ones(ends.size, dtype=bool)
    best = ends
    for n in range(2, min(max_n, done) + 1):
        alive &= ends >= n - 1
        back = np.where(alive, ends - (n - 1), 0)
        alive &= text[back] == tail[-n]
        if not alive.any():
            break
        best = ends[alive]
    end = int(best[np.argmin(np.abs(best - (done - 1)))])
    return list(prediction[end + 1 : end + 1 + k])
