"""Type stubs for the compiled `_bench` module (same API as `_bench_py`)."""

from array import array

def _bench_queue(
    n_live: int,
    n_ops: int,
    seed: int = 1,
    probe: array | None = None,
    probe_target: int = 0,
    release_gil: bool = True,
) -> tuple[int, int, int]: ...
def _bench_blocks(
    num_blocks: int,
    n_requests: int,
    n_ops: int,
    seed: int = 1,
    probe: array | None = None,
    probe_target: int = 0,
    release_gil: bool = True,
) -> tuple[int, int, int, int]: ...
