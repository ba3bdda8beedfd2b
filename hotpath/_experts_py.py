"""Pure-Python twin of `_experts.pyx`: the two-level expert allocator for MoE layers.

Same API, same slots, same errors as the compiled module; see `_experts.pyx` for the rules.
"""

from __future__ import annotations

import operator
from collections import OrderedDict


class ExpertAllocator:
    """Level 1: (layer, expert) -> resident slot, LRU with pinning. Level 2: workspace rows (twin)."""

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
    )

    def __init__(
        self, num_layers: int, num_experts: int, slots_per_layer: int, workspace_rows: int
    ) -> None:
        for name, value, low in (
            ("num_layers", num_layers, 1),
            ("num_experts", num_experts, 1),
            ("slots_per_layer", slots_per_layer, 1),
            ("workspace_rows", workspace_rows, 0),
        ):
            if operator.index(value) < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if slots_per_layer > num_experts:
            raise ValueError(
                f"slots_per_layer ({slots_per_layer}) must be <= num_experts ({num_experts})"
            )
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.slots_per_layer = slots_per_layer
        self.workspace_rows = workspace_rows
        self.hits = self.misses = self.evictions = 0
        self.rows_in_use = self.peak_rows = 0
        self._slot_of = [[-1] * num_experts for _ in range(num_layers)]
        self._expert_in = [[-1] * slots_per_layer for _ in range(num_layers)]
        self._pinned = [[False] * slots_per_layer for _ in range(num_layers)]
        # Unpinned slots per layer, least recently used first; empty slots start at the front.
        self._lru = [OrderedDict.fromkeys(range(slots_per_layer)) for _ in range(num_layers)]

    def _check(self, layer: int, expert: int) -> None:
        if not 0 <= operator.index(layer) < self.num_layers:
            raise ValueError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        if not 0 <= operator.index(expert) < self.num_experts:
            raise ValueError(f"expert {expert} is out of range 0..{self.num_experts - 1}")

    def acquire(self, layer: int, expert: int) -> tuple[int, bool]:
        """(slot, hit): the resident slot of this expert, loading it over the LRU unpinned slot."""
        self._check(layer, expert)
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

    def slot_of(self, layer: int, expert: int) -> int:
        """Resident slot of an expert or -1; changes no LRU order or counter."""
        self._check(layer, expert)
        return self._slot_of[layer][expert]

    def is_pinned(self, layer: int, expert: int) -> bool:
        """Whether a resident expert is pinned."""
        self._check(layer, expert)
        slot = self._slot_of[layer][expert]
        return slot >= 0 and self._pinned[layer][slot]

    def pin(self, layer: int, expert: int) -> None:
        """Keep a resident expert from eviction (idempotent)."""
        self._check(layer, expert)
        slot = self._slot_of[layer][expert]
        if slot < 0:
            raise ValueError(
                f"expert {expert} of layer {layer} is not resident; acquire() it first"
            )
        if not self._pinned[layer][slot]:
            self._pinned[layer][slot] = True
            del self._lru[layer][slot]

    def unpin(self, layer: int, expert: int) -> None:
        """Make a pinned expert evictable again, as the most recently used."""
        self._check(layer, expert)
        slot = self._slot_of[layer][expert]
        if slot < 0 or not self._pinned[layer][slot]:
            raise ValueError(f"expert {expert} of layer {layer} is not pinned")
        self._pinned[layer][slot] = False
        self._lru[layer][slot] = None

    def reserve_rows(self, n: int) -> int | None:
        """Offset of n workspace rows for this step, or None when the budget is short."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of rows ({n})")
        if self.rows_in_use + n > self.workspace_rows:
            return None
        offset = self.rows_in_use
        self.rows_in_use += n
        self.peak_rows = max(self.peak_rows, self.rows_in_use)
        return offset

    def release_rows(self) -> None:
        """End of step: every workspace row is free again."""
        self.rows_in_use = 0
