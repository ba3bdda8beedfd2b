"""Greedy verification of draft tokens: exact, the output is what decoding one at a time gives."""

from __future__ import annotations

from collections.abc import Sequence


def accept(drafts: Sequence[int], guesses: Sequence[int], bonus: int) -> list[int]:
    """The tokens a verify step yields: drafts while each equals the model's argmax at the
    position before it (`guesses[i]` scores `drafts[i]`), then the model's own token there (the
    first differing guess, or `bonus`, the argmax after the last draft)."""
    for i, draft in enumerate(drafts):
        if guesses[i] != draft:
            return [*drafts[:i], guesses[i]]
    return [*drafts, bonus]
