"""Stop-string matching over streamed text in O(new text) per token, whatever the number of strings."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

_SHIFT = 21  # code points fit in 21 bits: a transition's key is node << _SHIFT | ord(char)


class StopMatcher:
    """An Aho–Corasick automaton over a request's stop strings, fed the output text as it grows.

    Invariant: after `feed` has consumed text[:n], `_state` is the trie node for the longest
    suffix of text[:n] that is a prefix of some stop string, and `_longest[s]` is the length of
    the longest stop string that is a suffix of node s's string (0 if none). So a character
    costs one transition plus failure steps paid for by earlier transitions (amortized O(1)),
    never a pass over the strings; and of the stop strings that end at a position, the one
    that starts earliest is the longest. Transitions live in one int-keyed dict (~75 bytes a
    trie node, against ~230 for a dict per node).
    """

    __slots__ = ("_goto", "_fail", "_longest", "_state", "_consumed", "max_len", "steps")

    def __init__(self, stops: Iterable[str]) -> None:
        goto: dict[int, int] = {}
        longest = [0]
        children: list[list[tuple[int, int]]] = [[]]  # (char, child) per node, for the breadth-first pass
        for stop in stops:
            node = 0
            for ch in map(ord, stop):
                key = node << _SHIFT | ch
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(longest)
                    longest.append(0)
                    children.append([])
                    children[node].append((ch, nxt))
                node = nxt
            longest[node] = len(stop)
        fail = [0] * len(longest)
        queue = deque(child for _, child in children[0])
        while queue:  # breadth first: a node's suffix link is final before its children need it
            node = queue.popleft()
            longest[node] = max(longest[node], longest[fail[node]])
            for ch, child in children[node]:
                link = fail[node]
                while link and (link << _SHIFT | ch) not in goto:
                    link = fail[link]
                fail[child] = goto.get(link << _SHIFT | ch, 0)
                queue.append(child)
        self._goto = goto
        self._fail = fail
        self._longest = longest
        self._state = 0
        self._consumed = 0
        self.max_len = max(longest)  # the longest stop string: streamed text holds back max_len - 1 chars
        self.steps = 0  # transitions and failure steps taken so far: the matching work

    def feed(self, new_text: str) -> int | None:
        """Consume `new_text`; the start, in all the text fed so far, of the earliest-starting
        stop string that ends inside `new_text`, or None."""
        goto, fail, longest = self._goto, self._fail, self._longest
        state, pos, steps = self._state, self._consumed, 0
        earliest: int | None = None
        for ch in map(ord, new_text):
            pos += 1
            while state and (state << _SHIFT | ch) not in goto:
                state = fail[state]
                steps += 1
            state = goto.get(state << _SHIFT | ch, 0)
            steps += 1
            length = longest[state]
            if length and (earliest is None or pos - length < earliest):
                earliest = pos - length
        self._state, self._consumed = state, pos
        self.steps += steps
        return earliest
