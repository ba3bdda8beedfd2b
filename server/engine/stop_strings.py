"""Stop-string matching over streamed text in O(new text) per token, whatever the number of strings."""

from __future__ import annotations

from collections.abc import Iterable

import ahocorasick


class StopMatcher:
    """One Aho–Corasick automaton (pyahocorasick, in C) over a request's stop strings, fed the
    output text piece by piece as it grows.

    The search iterator keeps its state between pieces, so each character is scanned once, by
    one automaton transition, never by a pass over the strings; it reports every stop string
    that ends inside the piece, and the earliest start among them is where the text is cut.
    `steps` counts the work done in Python: characters handed to the automaton plus
    matches read back (no matches before the one piece that ends the request).
    """

    __slots__ = ("_search", "max_len", "steps")

    def __init__(self, stops: Iterable[str]) -> None:
        automaton = ahocorasick.Automaton()
        for stop in stops:
            automaton.add_word(stop, len(stop))
        automaton.make_automaton()
        self._search = automaton.iter("")
        # streamed text holds back max_len - 1 chars
        self.max_len = automaton.get_stats()["longest_word"]
        self.steps = 0

    def feed(self, new_text: str) -> int | None:
        """Consume `new_text`; the start, in all the text fed so far, of the earliest-starting
        stop string that ends inside `new_text`, or None."""
        self._search.set(new_text, False)  # False: go on from the state the last piece left
        self.steps += len(new_text)
        earliest = None
        for end, length in self._search:
            self.steps += 1
            start = end - length + 1
            earliest = start if earliest is None else min(earliest, start)
        return earliest
