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

from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.number cimport PyNumber_Index
from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc

from ._experts_py import check_expert_args
from ._limits import busy_error


cdef class ExpertAllocator:
    """Level 1: (layer, expert) -> resident slot, LRU with pinning. Level 2: workspace rows.

    Not thread-safe: callers serialise (see `_limits`); a call that overlaps another call on the
    same allocator raises RuntimeError and changes nothing. Every method is O(1) and keeps the
    GIL.
    """

    cdef int32_t* slot_of_expert  # [L * E] slot or -1
    cdef int32_t* expert_in_slot  # [L * S] expert or -1
    cdef unsigned char* pinned    # [L * S]
    cdef int32_t* prev            # [L * S + L]; node L * S + layer is that layer's sentinel
    cdef int32_t* next
    cdef int _busy  # set for the duration of every call that touches the tables
    cdef readonly Py_ssize_t num_layers
    cdef readonly Py_ssize_t num_experts
    cdef readonly Py_ssize_t slots_per_layer
    cdef readonly Py_ssize_t workspace_rows
    cdef public long long hits
    cdef public long long misses
    cdef public long long evictions
    cdef public Py_ssize_t rows_in_use
    cdef public Py_ssize_t peak_rows

    def __cinit__(self, *args, **kwargs):
        # Tables for zero layers, so an instance whose __init__ never ran (cls.__new__(cls))
        # refuses every (layer, expert) with a ValueError and has no workspace rows.
        self._build(0, 0, 0)

    def __init__(self, num_layers, num_experts, slots_per_layer, workspace_rows):
        L = PyNumber_Index(num_layers)
        E = PyNumber_Index(num_experts)
        S = PyNumber_Index(slots_per_layer)
        W = PyNumber_Index(workspace_rows)
        check_expert_args(L, E, S, W)
        if self._busy:
            raise busy_error("ExpertAllocator", "__init__")
        self._build(L, E, S)
        self.workspace_rows = W
        self.hits = self.misses = self.evictions = 0
        self.rows_in_use = self.peak_rows = 0

    cdef int _build(self, Py_ssize_t L, Py_ssize_t E, Py_ssize_t S) except -1:
        """Fresh tables for L layers of E experts and S slots (checked sizes), then swap them in."""
        cdef Py_ssize_t i, layer, node, tail, g
        cdef Py_ssize_t n_map = L * E if L * E > 0 else 1
        cdef Py_ssize_t n_slot = L * S if L * S > 0 else 1
        cdef Py_ssize_t n_node = L * S + L if L * S + L > 0 else 1
        cdef int32_t* slot_of_expert = <int32_t*>malloc(n_map * sizeof(int32_t))
        cdef int32_t* expert_in_slot = <int32_t*>malloc(n_slot * sizeof(int32_t))
        cdef unsigned char* pinned = <unsigned char*>malloc(n_slot)
        cdef int32_t* prev = <int32_t*>malloc(n_node * sizeof(int32_t))
        cdef int32_t* next = <int32_t*>malloc(n_node * sizeof(int32_t))
        if (slot_of_expert == NULL or expert_in_slot == NULL or pinned == NULL or prev == NULL
                or next == NULL):
            free(slot_of_expert)
            free(expert_in_slot)
            free(pinned)
            free(prev)
            free(next)
            raise MemoryError("ExpertAllocator: out of memory")
        for i in range(L * E):
            slot_of_expert[i] = -1
        for i in range(L * S):
            expert_in_slot[i] = -1
            pinned[i] = 0
        for layer in range(L):  # every slot unpinned, in slot order from the LRU head
            node = L * S + layer
            prev[node] = next[node] = <int32_t>node
            for i in range(S):
                g = layer * S + i
                tail = prev[node]
                next[tail] = <int32_t>g
                prev[g] = <int32_t>tail
                next[g] = <int32_t>node
                prev[node] = <int32_t>g
        self._release()
        self.slot_of_expert = slot_of_expert
        self.expert_in_slot = expert_in_slot
        self.pinned = pinned
        self.prev = prev
        self.next = next
        self.num_layers, self.num_experts, self.slots_per_layer = L, E, S
        return 0

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
        self.num_layers = self.num_experts = self.slots_per_layer = 0

    cdef inline int _enter(self, str method) except -1:
        if self._busy:
            raise busy_error("ExpertAllocator", method)
        self._busy = 1
        return 0

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

    cdef Py_ssize_t _index(self, object value, Py_ssize_t bound, str what) except -1:
        """A converted layer or expert id, checked against the current tables."""
        cdef int overflow = 0
        cdef long long i = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow or not 0 <= i < bound:
            raise ValueError(f"{what} {value} is out of range 0..{bound - 1}")
        return <Py_ssize_t>i

    def acquire(self, layer, expert):
        """(slot, hit): the resident slot of this expert, loading it over the LRU unpinned slot."""
        cdef Py_ssize_t l, e, S, head, slot, g, old
        layer, expert = PyNumber_Index(layer), PyNumber_Index(expert)
        self._enter("acquire")
        try:
            l = self._index(layer, self.num_layers, "layer")
            e = self._index(expert, self.num_experts, "expert")
            S = self.slots_per_layer
            head = self.num_layers * S + l
            slot = self.slot_of_expert[l * self.num_experts + e]
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
                    f"all {S} slots of layer {l} are pinned; "
                    "unpin an expert or raise slots_per_layer"
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
        finally:
            self._busy = 0

    def slot_of(self, layer, expert):
        """Resident slot of an expert or -1; changes no LRU order or counter."""
        cdef Py_ssize_t l, e
        layer, expert = PyNumber_Index(layer), PyNumber_Index(expert)
        self._enter("slot_of")
        try:
            l = self._index(layer, self.num_layers, "layer")
            e = self._index(expert, self.num_experts, "expert")
            return self.slot_of_expert[l * self.num_experts + e]
        finally:
            self._busy = 0

    def is_pinned(self, layer, expert):
        """Whether a resident expert is pinned."""
        cdef Py_ssize_t l, e, slot
        layer, expert = PyNumber_Index(layer), PyNumber_Index(expert)
        self._enter("is_pinned")
        try:
            l = self._index(layer, self.num_layers, "layer")
            e = self._index(expert, self.num_experts, "expert")
            slot = self.slot_of_expert[l * self.num_experts + e]
            return slot >= 0 and bool(self.pinned[l * self.slots_per_layer + slot])
        finally:
            self._busy = 0

    def pin(self, layer, expert):
        """Keep a resident expert from eviction (idempotent)."""
        cdef Py_ssize_t l, e, slot, g
        layer, expert = PyNumber_Index(layer), PyNumber_Index(expert)
        self._enter("pin")
        try:
            l = self._index(layer, self.num_layers, "layer")
            e = self._index(expert, self.num_experts, "expert")
            slot = self.slot_of_expert[l * self.num_experts + e]
            if slot < 0:
                raise ValueError(f"expert {e} of layer {l} is not resident; acquire() it first")
            g = l * self.slots_per_layer + slot
            if not self.pinned[g]:
                self.pinned[g] = 1
                self._unlink(g)
        finally:
            self._busy = 0

    def unpin(self, layer, expert):
        """Make a pinned expert evictable again, as the most recently used."""
        cdef Py_ssize_t l, e, slot, g
        layer, expert = PyNumber_Index(layer), PyNumber_Index(expert)
        self._enter("unpin")
        try:
            l = self._index(layer, self.num_layers, "layer")
            e = self._index(expert, self.num_experts, "expert")
            slot = self.slot_of_expert[l * self.num_experts + e]
            if slot < 0 or not self.pinned[l * self.slots_per_layer + slot]:
                raise ValueError(f"expert {e} of layer {l} is not pinned")
            g = l * self.slots_per_layer + slot
            self.pinned[g] = 0
            self._append(l, g)
        finally:
            self._busy = 0

    def reserve_rows(self, n):
        """Offset of n workspace rows for this step, or None when the budget is short."""
        cdef Py_ssize_t offset
        n = PyNumber_Index(n)
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of rows ({n})")
        self._enter("reserve_rows")
        try:
            # In Python ints: no overflow whatever n or the (public) rows_in_use hold.
            in_use = self.rows_in_use + n
            if in_use > self.workspace_rows:
                return None
            offset = self.rows_in_use
            self.rows_in_use = in_use
            if self.rows_in_use > self.peak_rows:
                self.peak_rows = self.rows_in_use
            return offset
        finally:
            self._busy = 0

    def release_rows(self):
        """End of step: every workspace row is free again."""
        self._enter("release_rows")
        try:
            self.rows_in_use = 0
        finally:
            self._busy = 0
