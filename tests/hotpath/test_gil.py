"""The compiled cores release the GIL: a Python thread keeps counting while a nogil batch runs.

The C loop itself reads the counter (a shared int64 buffer) at its start and every 256 ops, and
stops once it has seen the counter advance by TARGET. With the GIL held no Python thread can run
between those reads, so the advance would be exactly 0 (the release_gil=False control proves it);
no timing is involved.
"""

from __future__ import annotations

import threading
from array import array

import pytest

from tests.hotpath.conftest import load_impl

C = load_impl("cython")
TARGET = 1000
MAX_OPS = 20_000_000  # only reached if the counter never moves (the GIL was held)


def run_with_counter(batch, **kwargs):
    counter = array("q", [0])
    stop = threading.Event()
    started = threading.Event()

    def count() -> None:
        started.set()
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    started.wait()
    try:
        return batch(counter, **kwargs)
    finally:
        stop.set()
        thread.join()


BATCHES = {
    "queue": lambda probe, ops=MAX_OPS, **kw: C.bench_queue(1000, ops, 1, probe, TARGET, **kw),
    "blocks": lambda probe, ops=MAX_OPS, **kw: C.bench_blocks(
        4000, 400, ops, 1, probe, TARGET, **kw
    ),
}


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_python_thread_progresses_inside_the_nogil_batch(kind):
    result = run_with_counter(BATCHES[kind])
    done, advanced = result[1], result[2]
    assert advanced >= TARGET, f"the counter thread never ran during the batch ({advanced})"
    assert done < MAX_OPS


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_control_holding_the_gil_freezes_the_counter(kind):
    result = run_with_counter(BATCHES[kind], ops=200_000, release_gil=False)
    assert result[1] == 200_000 and result[2] == 0
