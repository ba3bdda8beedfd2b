"""KV block bookkeeping for requests over the hot-path BlockAllocator: prefix reuse and swap.

Prefix reuse: full block i of a request is identified by the chained hash
``h_i = hash((h_{i-1}, tokens of block i))`` with ``h_{-1} = 0``, so a hash names the whole
prefix up to the end of its block. The allocator maps hash -> block id; a hit is only taken
when the stored tokens of that block equal the request's tokens (a hash collision is a miss).
Shared blocks are reference counted by the allocator; a freed hashed block stays cached
(evictable, LRU) until its memory is needed. At least one token of a request is computed, so
its logits can be sampled::

    tokens:  |-- block 0 --|-- block 1 --|-- block 2 --|-- partial --|
    hit:     |<===== cached (full blocks) =====>|       (at most num_tokens // block_size blocks)
    compute:                                    |<-- chunked prefill -->|

When the hit covers every token (a block-aligned prompt seen before: repeated attempts at one
ARC task), only the last token is computed again, for its logits: `hit_tokens` is then
num_tokens - 1 and the scheduler marks that token `kv_present` (its K/V stays as the shared block
holds it; nothing is written there). Recomputing the whole last block instead would cost a
block of prefill per repeated prompt.

Claims: a request that starts computing its tokens claims every full block of them it has no
hit for, its whole prompt at once, until each is computed (then hashed) or the request lets go
of its blocks. A newcomer whose next block is claimed by another request waits for that block
rather than compute the same prefix alongside it (the scheduler lets an urgent one go ahead).
Chunked prefill makes that window many steps long: a prompt cut to fit a step cap takes a dozen
steps, and attempts at one ARC task arrive together (docs/design/deadline-steps.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from sloserve.hotpath import BlockAllocator
from sloserve.sched.request import Request

_ROOT_HASH = 0


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (a signed 64-bit int, deterministic in-process)."""
    return hash((parent, tuple(tokens)))


def adapter_root(adapter: str, uid: int = 0) -> int:
    """The chain's seed for a request of LoRA adapter `adapter` (load `uid`): two adapters, or two
    loads of one name, never share a block; requests of one load do."""
    return hash(("lora", adapter, uid))


class BlockManager:
    """Gives requests device blocks (with prefix hits) and host blocks (swap) and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_cache: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV pool needs >= 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.allocator = BlockAllocator(num_blocks)
        self.num_usable = num_blocks - 1
        self.num_host_blocks = num_host_blocks
        self._host_free = list(range(num_host_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._tokens: dict[int, tuple[int, ...]] = {}  # block id -> the tokens it was hashed with
        self._claims: dict[int, int] = {}  # hash -> how many requests claim that block
        # request id -> its claimed hashes, in block order
        self._claims_by_req: dict[str, list[int]] = {}
        # LoRA adapter name -> the seed of its requests' hash chains (set by the engine per load)
        self.adapter_roots: dict[str, int] = {}

    def root(self, req: Request) -> int:
        """The seed of `req`'s hash chain: the base model's, or its adapter's."""
        adapter = req.sampling.adapter
        if adapter is None:
            return _ROOT_HASH
        root = self.adapter_roots.get(adapter)
        return adapter_root(adapter) if root is None else root

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached(self) -> int:
        return self.allocator.num_cached

    @property
    def num_host_free(self) -> int:
        return len(self._host_free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------
    def find_prefix(
        self, tokens: Sequence[int], root: int = _ROOT_HASH
    ) -> tuple[list[int], list[int], int | None]:
        """(hit blocks, their hashes, hash of the next full block or None) of a chain seeded with
        `root` (BlockManager.root); changes nothing."""
        if not self.prefix_cache:
            return [], [], None
        bs, alloc = self.block_size, self.allocator
        blocks: list[int] = []
        hashes: list[int] = []
        parent = root
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(parent, chunk)
            block = alloc.lookup(h)
            if block < 0 or self._tokens.get(block) != chunk:
                return blocks, hashes, h
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes, None

    def prompt_hashes(
        self, tokens: Sequence[int], known: Sequence[int] = (), root: int = _ROOT_HASH
    ) -> list[int]:
        """The chained hashes of every full block of `tokens` (as find_prefix and claim hash them),
        continuing `known`, the hashes of its first blocks (find_prefix's hits and next hash), or
        seeded with `root` where none are known."""
        bs, hashes = self.block_size, list(known)
        parent = hashes[-1] if hashes else root
        for i in range(len(hashes), len(tokens) // bs):
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def hit_tokens(self, num_blocks: int, num_tokens: int) -> int:
        """Tokens a hit of `num_blocks` blocks spares computing: all of them but the request's last."""
        return min(num_blocks * self.block_size, num_tokens - 1)

    def is_cached(self, block_hash: int) -> bool:
        """True when a computed block with this hash is in the pool: a prefix hit."""
        return self.prefix_cache and self.allocator.lookup(block_hash) >= 0

    def is_claimed(self, block_hash: int | None) -> bool:
        """True when a running request is computing the block with this hash (see Claims)."""
        return block_hash is not None and block_hash in self._claims

    def acquire_prefix(self, req: Request, blocks: list[int], hashes: list[int]) -> int:
        """Give a request with no blocks the hit blocks; returns the number of tokens not to compute."""
        assert not req.block_table, "prefix hits are taken before any block is allocated"
        alloc = self.allocator
        for block in blocks:
            if alloc.ref_count(block) == 0:
                alloc.touch(block)
            else:
                alloc.incref(block)
        if self.prefix_cache:
            for _ in blocks:
                alloc.record_lookup(True)
            if len(blocks) < req.num_tokens // self.block_size:
                alloc.record_lookup(False)
        req.block_table = list(blocks)
        req.block_hashes = list(hashes)
        return self.hit_tokens(len(blocks), req.num_tokens)

    def claim(self, req: Request) -> None:
        """Claim every full block of `req`'s tokens not yet computed nor claimed (see Claims)."""
        if not self.prefix_cache:
            return
        claimed = self._claims_by_req.get(req.request_id, [])
        parent = (
            claimed[-1] if claimed else req.block_hashes[-1] if req.block_hashes else self.root(req)
        )
        bs, tokens = self.block_size, req.all_token_ids
        for i in range(len(req.block_hashes) + len(claimed), req.num_tokens // bs):
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            claimed.append(parent)
            self._claims[parent] = self._claims.get(parent, 0) + 1
        # NOTE: only a request that claims something gets an entry: `_release` drops entries
        # with claims, so an empty one would outlive its request
        if claimed:
            self._claims_by_req[req.request_id] = claimed

    def commit(self, req: Request) -> None:
        """Hash the blocks completed by `req.num_computed_tokens` so later requests can hit them."""
        if not self.prefix_cache:
            return
        start = len(req.block_hashes)
        hashes = self._new_full_hashes(req, req.num_computed_tokens)
        self._release(req, len(hashes))
        bs, alloc = self.block_size, self.allocator
        for offset, h in enumerate(hashes):
            i = start + offset
            req.block_hashes.append(h)
            block = req.block_table[i]
            if alloc.lookup(h) < 0:  # NOTE: a duplicate computed in the same step stays unhashed
                alloc.set_hash(block, h)
                self._tokens[block] = tuple(req.all_token_ids[i * bs : (i + 1) * bs])

    def _new_full_hashes(self, req: Request, end: int) -> list[int]:
        bs = self.block_size
        parent = req.block_hashes[-1] if req.block_hashes else self.root(req)
        out = []
        for i in range(len(req.block_hashes), end // bs):
            parent = chain_hash(parent, req.all_token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def _release(self, req: Request, count: int | None = None) -> None:
        """Drop the first `count` of req's claims (all of them if None)."""
        claimed = self._claims_by_req.get(req.request_id)
        if not claimed:
            return
        done = claimed if count is None else claimed[:count]
        for h in done:
            left = self._claims[h] - 1
            if left:
                self._claims[h] = left
            else:
                del self._claims[h]
        if count is None or count >= len(claimed):
            del self._claims_by_req[req.request_id]
        else:
            del claimed[:count]

    # ---- allocation --------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow req.block_table to cover positions [0, num_tokens); False (nothing taken) if short."""
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self.allocator.allocate(need)
        if blocks is None:
            return False
        req.block_table.extend(blocks)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the blocks of `req` past those covering positions [0, num_tokens) (a rejected
        draft's: never hashed, held by nobody else), tail first."""
        keep = self.blocks_for(num_tokens)
        if len(req.block_table) > keep:
            self.allocator.free(req.block_table[: keep - 1 : -1] if keep else req.block_table[::-1])
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        """Return every device and host block of `req` (device blocks tail first)."""
        self._release(req)
        if req.block_table:
            self.allocator.free(req.block_table[::-1])
        req.block_table = []
        req.block_hashes = []
        self.drop_swap(req)

    # ---- swap --------------------------------------------------------------------------
    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the computed blocks of `req` to host blocks; None (nothing changed) if the pool is short."""
        n = self.blocks_for(req.num_computed_tokens)
        if n == 0 or n > len(self._host_free):
            return None
        hosts = [self._host_free.pop() for _ in range(n)]
        pairs = list(zip(req.block_table[:n], hosts, strict=True))
        self._release(req)
        self.allocator.free(req.block_table[::-1])
        req.block_table = []
        req.host_table = hosts
        return pairs

    def swap_in(self, req: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back onto device blocks; None (nothing changed) if short."""
        blocks = self.allocator.allocate(len(req.host_table))
        if blocks is None:
            return None
        pairs = list(zip(req.host_table, blocks, strict=True))
        self._host_free.extend(reversed(req.host_table))
        req.host_table = []
        req.block_table = blocks
        return pairs

    def drop_swap(self, req: Request) -> None:
        """Forget a swapped-out copy (abort, or fall back to recompute)."""
        if req.host_table:
            self._host_free.extend(reversed(req.host_table))
            req.host_table = []
