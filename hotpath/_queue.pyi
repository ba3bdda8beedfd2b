"""Type stubs for the compiled `_queue` module (same API as `_queue_py`)."""

from array import array

class RequestQueue:
    aging: float
    max_wait_s: float
    length_weight_s: float
    def __init__(
        self,
        aging: float = 0.95,
        max_wait_s: float = 0.2,
        length_weight_s: float = 1e-4,
        capacity: int = 1024,
    ) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, handle: object) -> bool: ...
    def push(self, handle: int, deadline: float, prompt_tokens: int, now: float) -> None: ...
    def peek(self) -> int: ...
    def pop(self) -> int: ...
    def remove(self, handle: int) -> None: ...
    def rekey(self, now: float) -> None: ...
    def handles_in_order(self) -> list[int]: ...
    _probe_advance: int
    def _set_gil_probe(
        self,
        probe: array | None = None,
        target: int = 0,
        max_spins: int = 0,
        release_gil: bool = True,
    ) -> None: ...

def target_batch_size(max_batch: int, queue_depth: int, decay: float = 0.9) -> int: ...
def _bench_queue(
    n_live: int,
    n_ops: int,
    seed: int = 1,
    probe: array | None = None,
    probe_target: int = 0,
    release_gil: bool = True,
) -> tuple[int, int, int]: ...
