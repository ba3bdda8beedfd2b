"""Size limits and the concurrent-call error shared by the compiled hot path and its twins.

The limits keep every C size product far from overflow and every id inside its C type;
constructors raise ValueError above them and `sloserve.config` validates against the same
numbers, so a configuration that passes validation never reaches a size the hot path refuses.

Thread-safety contract (both implementations): hot-path objects are NOT thread-safe; callers
serialise (the engine holds its lock around every call). The contract is enforced, not just
stated: every method that reads or writes the tables marks the object busy for the whole call,
so a second call that arrives meanwhile (another thread during a GIL-free section, or a
re-entrant call from an argument's ``__index__`` or a finaliser) raises RuntimeError before it
touches anything, and the first call completes unaffected. O(1) counter reads (``len()``,
``num_free`` and the other properties, the public counters) are not guarded.
"""

from __future__ import annotations

# RequestQueue: the initial reservation (and SchedulerConfig.max_waiting): ~100 bytes per
# entry, so the largest reservation is ~1.7 GB, and the most entries a queue ever holds (heap
# nodes store the entry slot as an int32).
MAX_QUEUE_CAPACITY = 2**24
MAX_QUEUE_ENTRIES = 2**31 - 1
# BlockAllocator: block ids and list links are int32 and the two list sentinels take the ids
# num_blocks and num_blocks + 1; a refcount is an int32 too.
MAX_BLOCKS = 2**31 - 3
MAX_REFCOUNT = 2**31 - 1
# ExpertAllocator: num_layers * num_experts (the largest table) and the workspace row budget.
MAX_EXPERT_ENTRIES = 2**24
MAX_WORKSPACE_ROWS = 2**62


def busy_error(owner: str, method: str) -> RuntimeError:
    """The error of a call that arrives while another call on the same object is running."""
    return RuntimeError(
        f"{owner}.{method}: another call on this {owner} is in progress (a second thread, or a "
        "re-entrant call from __index__ or a finaliser); hot-path objects are not thread-safe, "
        "callers must serialise their calls"
    )
