"""How many drafts a request's next verify step carries, from how its last one went."""

from __future__ import annotations


def next_depth(depth: int, drafted: int, accepted: int, most: int) -> int:
    """Twice the depth (up to `most`) after every draft was accepted, else one more than were.

    A verify row costs about what a decode row costs (docs/design/speculative-decoding.md), so
    drafts the model rejects are paid for: a prediction the output left, or text that stopped
    repeating, falls to one draft a step at once, and grows back while the drafts keep coming true.
    """
    if accepted >= drafted:
        return min(most, max(depth, 2 * drafted))
    return max(1, accepted + 1)
