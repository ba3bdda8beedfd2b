# cython: language_level=3
"""Two-level expert allocator for mixture-of-experts layers, over C arrays.

Level 1 maps (layer, expert) to one of `slots_per_layer` resident slots of that layer. Each
layer keeps its unpinned slots in an LRU list threaded through flat prev/next arrays (one
sentinel per layer); empty slots start at the LRU head in slot order, so slots fill 0, 1, ...
before anything is evicted. A hit moves the slot to the MRU tail; a miss takes the LRU head,
evicting its expert. Pinned slots leave the list (never evicted) and rejoin it as MRU when
unpinned; a miss on a layer whose slots are all pinned is a ValueError.

Level 2 is a bump allocator over `workspace_rows` token rows: `reserve_rows(n)` returns the
offset of n contiguous rows or None when the step's budget is short; `release_rows()` frees
them all at the end of the step.
"""

from cpython.number cimport PyNumber_Index
from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc


cdef class ExpertAllocator:
    """Level 1: (layer, expert) -> resident slot, LRU with pinning. Level 2: workspace rows."""

    cdef int32_t* slot_of_expert  # [L * E] slot or -1
    cdef int32_t* expert_in_slot  # [L * S] expert or -1
    cdef unsigned char* pinned    # [L * S]
    cdef int32_t* prev            # [L * S + L]; node L * S + layer is that layer's sentinel
    cdef int32_t* next
    cdef readonly Py_ssize_t num_layers
    cdef readonly Py_ssize_t num_experts
    cdef readonly Py_ssize_t slots_per_layer
    cdef readonly Py_ssize_t workspace_rows
    cdef public long long hits
    cdef public long long misses
    cdef public long long evictions
    cdef public Py_ssize_t rows_in_use
    cdef public Py_ssize_t peak_rows

    def __init__(self, num_layers, num_experts, slots_per_layer, workspace_rows):
        cdef Py_ssize_t L, E, S, i, layer, node
        for name, value, low in (
            ("num_layers", num_layers, 1),
            ("num_experts", num_experts, 1),
            ("slots_per_layer", slots_per_layer, 1),
            ("workspace_rows", workspace_rows, 0),
        ):
            if PyNumber_Index(value) < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if slots_per_layer > num_experts:
            raise ValueError(
                f"slots_per_layer ({slots_per_layer}) must be <= num_experts ({num_experts})"
            )
        L, E, S = num_layers, num_experts, slots_per_layer
        self._release()
        self.num_layers, self.num_experts, self.slots_per_layer = L, E, S
        self.workspace_rows = workspace_rows
        self.hits = self.misses = self.evictions = 0
        self.rows_in_use = self.peak_rows = 0
        self.slot_of_expert = <int32_t*>malloc(L * E * sizeof(int32_t))
        self.expert_in_slot = <int32_t*>malloc(L * S * sizeof(int32_t))
        self.pinned = <unsigned char*>malloc(L * S)
        self.prev = <int32_t*>malloc((L * S + L) * sizeof(int32_t))
        self.next = <int32_t*>malloc((L * S + L) * sizeof(int32_t))
        if (self.slot_of_expert == NULL or self.expert_in_slot == NULL or self.pinned == NULL
                or self.prev == NULL or self.next == NULL):
            self._release()
            raise MemoryError("ExpertAllocator: out of memory")
        for i in range(L * E):
            self.slot_of_expert[i] = -1
        for i in range(L * S):
            self.expert_in_slot[i] = -1
            self.pinned[i] = 0
        for layer in range(L):
            node = L * S + layer
            self.prev[node] = self.next[node] = <int32_t>node
            for i in range(S):
                self._append(layer, layer * S + i)

    def __dealloc__(self):
        self._release()

    cdef void _release(self) noexcept:
        free(self.slot_of_expert)
        free(self.expert_in_slot)
        free(self.pinned)
        free(self.prev)
        free(self.next)
        self.slot_of_expert = self.expert_in_slot = self.prev = self.next = NULL
        self.pinned = NULL

    cdef inline void _unlink(self, Py_ssize_t g) noexcept nogil:
        self.next[self.prev[g]] = self.next[g]
        self.prev[self.next[g]] = self.prev[g]

    cdef inline void _append(self, Py_ssize_t layer, Py_ssize_t g) noexcept nogil:
        cdef Py_ssize_t head = self.num_layers * self.slots_per_layer + layer
        cdef int32_t tail = self.prev[head]
        self.next[tail] = <int32_t>g
        self.prev[g] = tail
        self.next[g] = <int32_t>head
        self.prev[head] = <int32_t>g

    cdef int _check(self, layer, expert) except -1:
        if not 0 <= PyNumber_Index(layer) < self.num_layers:
            raise ValueError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        if not 0 <= PyNumber_Index(expert) < self.num_experts:
            raise ValueError(f"expert {expert} is out of range 0..{self.num_experts - 1}")
        return 0

    def acquire(self, layer, expert):
        """(slot, hit): the resident slot of this expert, loading it over the LRU unpinned slot."""
        self._check(layer, expert)
        cdef Py_ssize_t l = layer, e = expert, S = self.slots_per_layer
        cdef Py_ssize_t head = self.num_layers * S + l
        cdef Py_ssize_t slot = self.slot_of_expert[l * self.num_experts + e]
        cdef Py_ssize_t g, old
        if slot >= 0:
            self.hits += 1
            g = l * S + slot
            if not self.pinned[g]:
                self._unlink(g)
                self._append(l, g)
            return slot, True
        g = self.next[head]
        if g == head:
            raise ValueError(
                f"all {S} slots of layer {l} are pinned; unpin an expert or raise slots_per_layer"
            )
        slot = g - l * S
        old = self.expert_in_slot[g]
        if old >= 0:
            self.slot_of_expert[l * self.num_experts + old] = -1
            self.evictions += 1
        self.expert_in_slot[g] = <int32_t>e
        self.slot_of_expert[l * self.num_experts + e] = <int32_t>slot
        self._unlink(g)
        self._append(l, g)
        self.misses += 1
        return slot, False

    def slot_of(self, layer, expert):
        """Resident slot of an expert or -1; changes no LRU order or counter."""
        self._check(layer, expert)
        return self.slot_of_expert[<Py_ssize_t>layer * self.num_experts + <Py_ssize_t>expert]

    def is_pinned(self, layer, expert):
        """Whether a resident expert is pinned."""
        self._check(layer, expert)
        cdef Py_ssize_t l = layer
        cdef Py_ssize_t slot = self.slot_of_expert[l * self.num_experts + <Py_ssize_t>expert]
        return slot >= 0 and bool(self.pinned[l * self.slots_per_layer + slot])

    def pin(self, layer, expert):
        """Keep a resident expert from eviction (idempotent)."""
        self._check(layer, expert)
        cdef Py_ssize_t l = layer
        cdef Py_ssize_t slot = self.slot_of_expert[l * self.num_experts + <Py_ssize_t>expert]
        cdef Py_ssize_t g
        if slot < 0:
            raise ValueError(f"expert {expert} of layer {layer} is not resident; acquire() it first")
        g = l * self.slots_per_layer + slot
        if not self.pinned[g]:
            self.pinned[g] = 1
            self._unlink(g)

    def unpin(self, layer, expert):
        """Make a pinned expert evictable again, as the most recently used."""
        self._check(layer, expert)
        cdef Py_ssize_t l = layer
        cdef Py_ssize_t slot = self.slot_of_expert[l * self.num_experts + <Py_ssize_t>expert]
        cdef Py_ssize_t g = l * self.slots_per_layer + slot
        if slot < 0 or not self.pinned[g]:
            raise ValueError(f"expert {expert} of layer {layer} is not pinned")
        self.pinned[g] = 0
        self._append(l, g)

    def reserve_rows(self, n):
        """Offset of n workspace rows for this step, or None when the budget is short."""
        cdef Py_ssize_t count = PyNumber_Index(n)
        cdef Py_ssize_t offset
        if count < 0:
            raise ValueError(f"cannot reserve a negative number of rows ({count})")
        if self.rows_in_use + count > self.workspace_rows:
            return None
        offset = self.rows_in_use
        self.rows_in_use += count
        if self.rows_in_use > self.peak_rows:
            self.peak_rows = self.rows_in_use
        return offset

    def release_rows(self):
        """End of step: every workspace row is free again."""
        self.rows_in_use = 0
