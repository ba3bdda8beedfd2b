"""Pure-Python twin of `_experts.pyx`: the two-level expert allocator for MoE layers.

Same API, same slots, same errors as the compiled module; see `_experts.pyx` for the rules.
"""

from __future__ import annotations

import operator
from _thread import allocate_lock
from collections import OrderedDict

from ._limits import MAX_EXPERT_ENTRIES, MAX_WORKSPACE_ROWS, busy_error


def check_expert_args(
    num_layers: int, num_experts: int, slots_per_layer: int, workspace_rows: int
) -> None:
    """Raise ValueError naming the first bad (already converted) constructor argument."""
    for name, value, low in (
        ("num_layers", num_layers, 1),
        ("num_experts", num_experts, 1),
        ("slots_per_layer", slots_per_layer, 1),
        ("workspace_rows", workspace_rows, 0),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if slots_per_layer > num_experts:
        raise ValueError(
            f"slots_per_layer ({slots_per_layer}) must be <= num_experts ({num_experts})"
        )
    if num_layers * num_experts > MAX_EXPERT_ENTRIES:
        raise ValueError(
            f"num_layers * num_experts must be <= {MAX_EXPERT_ENTRIES} "
            f"(sloserve.hotpath.MAX_EXPERT_ENTRIES), got {num_layers} * {num_experts}"
        )
    if workspace_rows > MAX_WORKSPACE_ROWS:
        raise ValueError(
            f"workspace_rows must be <= {MAX_WORKSPACE_ROWS} "
            f"(sloserve.hotpath.MAX_WORKSPACE_ROWS), got {workspace_rows}"
        )


class ExpertAllocator:
    """Level 1: (layer, expert) -> resident slot, LRU with pinning. Level 2: workspace rows (twin).

    Not thread-safe: callers serialise (see `_limits`); a call that overlaps another call on the
    same allocator raises RuntimeError and changes nothing, as in the compiled module.
    """

    __slots__ = (
        "num_layers",
        "num_experts",
        "slots_per_layer",
        "workspace_rows",
        "hits",
        "misses",
        "evictions",
        "rows_in_use",
        "peak_rows",
        "_slot_of",
        "_expert_in",
        "_pinned",
        "_lru",
        "_guard",
    )

    def __new__(cls, *args: object, **kwargs: object) -> ExpertAllocator:
        # Like the compiled __cinit__: an instance whose __init__ never ran has zero layers, so
        # it refuses every (layer, expert) with a ValueError and has no workspace rows.
        self = super().__new__(cls)
        self._guard = allocate_lock()
        self._reset(0, 0, 0, 0)
        return self

    def __init__(
        self, num_layers: int, num_experts: int, slots_per_layer: int, workspace_rows: int
    ) -> None:
        num_layers, num_experts = operator.index(num_layers), operator.index(num_experts)
        slots_per_layer, workspace_rows = (
            operator.index(slots_per_layer),
            operator.index(workspace_rows),
        )
        check_expert_args(num_layers, num_experts, slots_per_layer, workspace_rows)
        if not self._guard.acquire(False):
            raise busy_error("ExpertAllocator", "__init__")
        try:
            self._reset(num_layers, num_experts, slots_per_layer, workspace_rows)
        finally:
            self._guard.release()

    def _reset(self, num_layers: int, num_experts: int, slots_per_layer: int, rows: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.slots_per_layer = slots_per_layer
        self.workspace_rows = rows
        self.hits = self.misses = self.evictions = 0
        self.rows_in_use = self.peak_rows = 0
        self._slot_of = [[-1] * num_experts for _ in range(num_layers)]
        self._expert_in = [[-1] * slots_per_layer for _ in range(num_layers)]
        self._pinned = [[False] * slots_per_layer for _ in range(num_layers)]
        # Unpinned slots per layer, least recently used first; empty slots start at the front.
        self._lru = [OrderedDict.fromkeys(range(slots_per_layer)) for _ in range(num_layers)]

    def _enter(self, method: str, layer: int, expert: int) -> None:
        """Take the guard, then check the (already converted) ids against the current tables."""
        if not self._guard.acquire(False):
            raise busy_error("ExpertAllocator", method)
        if not 0 <= layer < self.num_layers:
            self._guard.release()
            raise ValueError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        if not 0 <= expert < self.num_experts:
            self._guard.release()
            raise ValueError(f"expert {expert} is out of range 0..{self.num_experts - 1}")

    def acquire(self, layer: int, expert: int) -> tuple[int, bool]:
        """(slot, hit): the resident slot of this expert, loading it over the LRU unpinned slot."""
        layer, expert = operator.index(layer), operator.index(expert)
        self._enter("acquire", layer, expert)
        try:
            slot = self._slot_of[layer][expert]
            lru = self._lru[layer]
            if slot >= 0:
                self.hits += 1
                if slot in lru:
                    lru.move_to_end(slot)
                return slot, True
            if not lru:
                raise ValueError(
                    f"all {self.slots_per_layer} slots of layer {layer} are pinned; "
                    "unpin an expert or raise slots_per_layer"
                )
            slot = lru.popitem(last=False)[0]
            old = self._expert_in[layer][slot]
            if old >= 0:
                self._slot_of[layer][old] = -1
                self.evictions += 1
            self._expert_in[layer][slot] = expert
            self._slot_of[layer][expert] = slot
            lru[slot] = None
            self.misses += 1
            return slot, False
        finally:
            self._guard.release()

    def slot_of(self, layer: int, expert: int) -> int:
        """Resident slot of an expert or -1; changes no LRU order or counter."""
        layer, expert = operator.index(layer), operator.index(expert)
        self._enter("slot_of", layer, expert)
        try:
            return self._slot_of[layer][expert]
        finally:
            self._guard.release()

    def is_pinned(self, layer: int, expert: int) -> bool:
        """Whether a resident expert is pinned."""
        layer, expert = operator.index(layer), operator.index(expert)
        self._enter("is_pinned", layer, expert)
        try:
            slot = self._slot_of[layer][expert]
            return slot >= 0 and self._pinned[layer][slot]
        finally:
            self._guard.release()

    def pin(self, layer: int, expert: int) -> None:
        """Keep a resident expert from eviction (idempotent)."""
        layer, expert = operator.index(layer), operator.index(expert)
        self._enter("pin", layer, expert)
        try:
            slot = self._slot_of[layer][expert]
            if slot < 0:
                raise ValueError(
                    f"expert {expert} of layer {layer} is not resident; acquire() it first"
                )
            if not self._pinned[layer][slot]:
                self._pinned[layer][slot] = True
                del self._lru[layer][slot]
        finally:
            self._guard.release()

    def unpin(self, layer: int, expert: int) -> None:
        """Make a pinned expert evictable again, as the most recently used."""
        layer, expert = operator.index(layer), operator.index(expert)
        self._enter("unpin", layer, expert)
        try:
            slot = self._slot_of[layer][expert]
            if slot < 0 or not self._pinned[layer][slot]:
                raise ValueError(f"expert {expert} of layer {layer} is not pinned")
            self._pinned[layer][slot] = False
            self._lru[layer][slot] = None
        finally:
            self._guard.release()

    def reserve_rows(self, n: int) -> int | None:
        """Offset of n workspace rows for this step, or None when the budget is short."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of rows ({n})")
        if not self._guard.acquire(False):
            raise busy_error("ExpertAllocator", "reserve_rows")
        try:
            if self.rows_in_use + n > self.workspace_rows:
                return None
            offset = self.rows_in_use
            self.rows_in_use += n
            self.peak_rows = max(self.peak_rows, self.rows_in_use)
            return offset
        finally:
            self._guard.release()

    def release_rows(self) -> None:
        """End of step: every workspace row is free again."""
        if not self._guard.acquire(False):
            raise busy_error("ExpertAllocator", "release_rows")
        try:
            self.rows_in_use = 0
        finally:
            self._guard.release()
