"""Waiting-queue policies behind one tiny interface: `slo` (urgency + aging), `priority`, `fifo`."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from sloserve.config import POLICIES, SchedulerConfig
from sloserve.hotpath import RequestQueue
from sloserve.sched.request import Request

__all__ = ["POLICIES", "WaitingQueue", "make_queue"]


class WaitingQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, req: Request, now: float) -> None: ...
    def requeue(self, req: Request) -> None: ...  # a preempted request, keeping its place
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def rekey(self, now: float) -> None: ...
    def in_order(self) -> list[Request]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class SloQueue:
    """Urgency order from the hot-path RequestQueue (deadline, prompt length, aging, 200 ms guard)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._queue = RequestQueue(
            aging=config.aging,
            max_wait_s=config.max_wait_s,
            length_weight_s=config.length_weight_s,
            capacity=config.max_waiting,
        )
        self._reqs: dict[int, Request] = {}

    def add(self, req: Request, now: float) -> None:
        self._queue.push(req.handle, req.deadline, req.num_prompt_tokens, now)
        self._reqs[req.handle] = req

    def requeue(self, req: Request) -> None:
        # NOTE: pushed as if queued since arrival: its deadline keeps its urgency and the
        # starvation guard sees the whole time it has been in the system.
        self.add(req, req.arrival_time)

    def peek(self) -> Request:
        return self._reqs[self._queue.peek()]

    def pop(self) -> Request:
        return self._reqs.pop(self._queue.pop())

    def remove(self, req: Request) -> None:
        self._queue.remove(req.handle)
        del self._reqs[req.handle]

    def rekey(self, now: float) -> None:
        self._queue.rekey(now)

    def in_order(self) -> list[Request]:
        return [self._reqs[h] for h in self._queue.handles_in_order()]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs.values()))


class FifoQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request, now: float) -> None:
        self._queue.append(req)

    def requeue(self, req: Request) -> None:
        # Keep arrival order among preempted requests at the front.
        i = 0
        while (
            i < len(self._queue)
            and self._queue[i].arrival_time <= req.arrival_time
            and self._queue[i].status == req.status
        ):
            i += 1
        self._queue.insert(i, req)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty queue")
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def rekey(self, now: float) -> None:
        pass

    def in_order(self) -> list[Request]:
        return list(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


class PriorityQueue:
    """vLLM's priority scheme: lower `priority` first, then arrival (FCFS within a priority).

    Kept sorted by (priority, arrival, handle); a preempted request goes back to its place.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._reqs: dict[int, Request] = {}

    @staticmethod
    def key(req: Request) -> tuple[int, float, int]:
        return req.priority, req.arrival_time, req.handle

    def add(self, req: Request, now: float) -> None:
        bisect.insort(self._keys, self.key(req))
        self._reqs[req.handle] = req

    def requeue(self, req: Request) -> None:
        self.add(req, req.arrival_time)

    def peek(self) -> Request:
        if not self._keys:
            raise IndexError("peek from an empty queue")
        return self._reqs[self._keys[0][2]]

    def pop(self) -> Request:
        if not self._keys:
            raise IndexError("pop from an empty queue")
        return self._reqs.pop(self._keys.pop(0)[2])

    def remove(self, req: Request) -> None:
        key = self.key(req)
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            raise KeyError(req.request_id)
        del self._keys[i]
        del self._reqs[req.handle]

    def rekey(self, now: float) -> None:
        pass

    def in_order(self) -> list[Request]:
        return [self._reqs[h] for _, _, h in self._keys]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs.values()))


def make_queue(config: SchedulerConfig) -> WaitingQueue:
    """The waiting queue for `config.policy`; ValueError names the known policies."""
    if config.policy == "slo":
        return SloQueue(config)
    if config.policy == "fifo":
        return FifoQueue(config)
    if config.policy == "priority":
        return PriorityQueue(config)
    raise ValueError(
        f"unknown scheduling policy {config.policy!r}: use one of {', '.join(POLICIES)}"
    )
