"""The prompt blocks of queued requests: prefix work that one of them will do for all.

Requests that share a prompt prefix (ARC-AGI-2 attempts of one task: the same training grids)
compute it once. The first to start claims its blocks and the others wait for them
(BlockManager.is_claimed), then take them from the prefix cache. In a burst nothing is cached
or claimed yet when they arrive, so admission used to price every one of them for its whole
prompt and refused requests that would have been served in time. Admission asks this registry
which of a newcomer's blocks a request queued before it will compute, and prices the newcomer
(and, through Request.expected_cached_tokens, the backlog it joins) without them.

Only never-started requests are held: a started one claims or caches its blocks itself.
"""

from __future__ import annotations

from collections import Counter

from sloserve.sched.block_manager import BlockManager
from sloserve.sched.request import Request


class QueuedPrefixes:
    """Counts of full-block hashes over the prompts of the queued, never-started requests."""

    def __init__(self) -> None:
        self._count: Counter[int] = Counter()
        self._held: dict[str, list[int]] = {}  # request id -> its prompt's block hashes

    def add(self, request_id: str, hashes: list[int]) -> None:
        if request_id in self._held or not hashes:
            return
        self._held[request_id] = hashes
        self._count.update(hashes)

    def price(
        self, req: Request, bm: BlockManager, found: tuple[list[int], list[int], int | None]
    ) -> tuple[int, list[int]]:
        """(prompt tokens `req` finds cached or being computed by a running request, its prompt's
        block hashes), from what `bm.find_prefix` `found` for it; sets req.expected_cached_tokens
        to those plus the tokens of the blocks that follow them in the prompt of a request queued
        before it."""
        blocks, hit_hashes, next_hash = found
        if next_hash is None:  # no miss: all cached, or no prefix reuse for this request
            cached = bm.hit_tokens(len(blocks), req.num_tokens)
            req.expected_cached_tokens = cached
            return cached, []
        hashes = bm.prompt_hashes(req.prompt_token_ids, [*hit_hashes, next_hash])
        claimed = len(blocks)
        while claimed < len(hashes) and bm.is_claimed(hashes[claimed]):
            claimed += 1
        shared = claimed
        while shared < len(hashes) and (bm.is_claimed(hashes[shared]) or hashes[shared] in self):
            shared += 1
        req.expected_cached_tokens = bm.hit_tokens(shared, req.num_tokens)
        return bm.hit_tokens(claimed, req.num_tokens), hashes

    def own_work(self, req: Request, bm: BlockManager) -> int:
        """Prompt tokens `req` (queued, never started) would compute if it started now: all but
        its leading blocks that are cached or that a running request is computing."""
        hashes = self._held.get(req.request_id)
        if not hashes:  # held none: all cached when it came, or no prefix reuse
            return req.num_tokens - req.expected_cached_tokens
        ready = 0
        while ready < len(hashes) and (bm.is_cached(hashes[ready]) or bm.is_claimed(hashes[ready])):
            ready += 1
        return req.num_tokens - bm.hit_tokens(ready, req.num_tokens)

    def discard(self, request_id: str) -> None:
        """Forget a request (started, finished or refused); nothing if it is not held."""
        hashes = self._held.pop(request_id, None)
        if hashes is None:
            return
        self._count.subtract(hashes)
        for h in hashes:
            if self._count[h] <= 0:
                self._count.pop(h, None)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._count

    def __len__(self) -> int:
        return len(self._held)
