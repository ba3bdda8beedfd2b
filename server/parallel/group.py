"""The ranks' rendezvous, the all-reduce the model calls, and the channel rank 0 drives the others on.

Rendezvous follows torchrun's conventions: rank 0 hosts a TCPStore at (master_addr, master_port)
and every other rank connects to it, announces itself, and waits. Rank 0 waits for all of them
while it watches its own local workers, so a worker that dies before joining fails start-up at
once rather than after a timeout; then every rank joins the process group. The compute group is
NCCL on CUDA and gloo on a CPU; the command channel (plain data: each step's SchedulerOutput) is
always gloo, so it never touches a device.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# NOTE: the engine may idle for hours while the workers wait on the command channel: a collective
# timeout would kill them. A dead peer is noticed at once anyway (its sockets close: gloo raises).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
JOIN_POLL_S = 0.05


@dataclass(slots=True)
class ReduceTimer:
    """Count and seconds of the all-reduces a rank ran (host time: on a CPU the reduce is synchronous)."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def as_dict(self) -> dict:
        return {
            "all_reduce_calls": self.calls,
            "all_reduce_seconds": round(self.seconds, 6),
            "all_reduce_bytes": self.bytes,
        }


@dataclass(slots=True)
class RankGroup:
    """One rank's view of the tensor-parallel group: who it is, and its two communicators."""

    rank: int
    size: int
    store: Any
    commands: Any  # the gloo group of the command channel
    timer: ReduceTimer = field(default_factory=ReduceTimer)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same result."""
        began = time.perf_counter()
        dist.all_reduce(x)
        self.timer.seconds += time.perf_counter() - began
        self.timer.calls += 1
        self.timer.bytes += x.numel() * x.element_size()
        return x

    def send(self, command: tuple) -> None:
        """Rank 0: broadcast one command (a name and plain-data arguments) to every rank."""
        dist.broadcast_object_list([command], src=0, group=self.commands)

    def receive(self) -> tuple:
        """Ranks > 0: block until rank 0 sends the next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, on every rank (start-up status, block counts)."""
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.commands)
        return values

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def host_store(addr: str, port: int, world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store (port 0: a free one, read back from `store.port`)."""
    return dist.TCPStore(
        addr, port, world, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def wait_for_ranks(
    store: dist.TCPStore, world: int, timeout_s: float, check: Callable[[], None] = lambda: None
) -> None:
    """Rank 0: wait until ranks 1.. have announced themselves; `check` raises if a local worker died."""
    keys = [f"joined/{r}" for r in range(1, world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        check()
        if time.monotonic() > deadline:
            missing = [k.split("/")[1] for k in keys if not store.check([k])]
            raise RuntimeError(
                f"tensor-parallel ranks {', '.join(missing)} did not join within {timeout_s:.0f} s "
                "(are the other nodes started with the same --master-addr and --master-port?)"
            )
        time.sleep(JOIN_POLL_S)


def join(
    rank: int,
    world: int,
    device: torch.device,
    store: dist.TCPStore | None = None,
    *,
    addr: str = "",
    port: int = 0,
    timeout_s: float = 600.0,
) -> RankGroup:
    """Join the group as `rank`: rank 0 passes the store it hosts (after wait_for_ranks), the others
    the master's address and port."""
    if store is None:
        store = dist.TCPStore(addr, port, world, False, datetime.timedelta(seconds=timeout_s))
        store.set(f"joined/{rank}", "1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    commands = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return RankGroup(rank, world, store, commands)
