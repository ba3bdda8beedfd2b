"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from collections.abc import Callable, Sequence

_CONTEXT = 5  # prompt tokens kept as decoding context (word boundaries, leading spaces)


class IncrementalDetokenizer:
    """Turns one token at a time into new text.

    Decodes a sliding window ``ids[prefix_offset:]`` and emits what it adds beyond
    ``ids[prefix_offset:read_offset]``; a window that ends in U+FFFD (an incomplete UTF-8
    sequence) is held back until the next token completes it.
    """

    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token: int) -> str:
        """The text that `token` completes (possibly '')."""
        self._ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (at the end of the request)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return delta
        return ""
