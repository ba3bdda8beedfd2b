"""TensorParallelRunner: rank 0's ModelRunner, driving the other ranks through the same calls.

The engine sees one runner. Each call that runs a forward (execute, warmup, time_steps, probe)
is first broadcast to the other ranks as plain data -- the SchedulerOutput, whose block ids come
from the one block manager on rank 0 -- then run here; every rank runs the same code on its
shard, so the all-reduces inside the forwards pair up. Only rank 0's step results are used.

Any failure leaves the ranks out of step, so the first one breaks the runner for good: every
later call raises with the reason (a worker that died: its rank and exit status), the engine
stops, and the front end reports NOT_SERVING.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from typing import Any

from sloserve.config import SloserveConfig
from sloserve.models.loader import resolve_model_path
from sloserve.models.shard import check_divisible
from sloserve.models.spec import load_spec
from sloserve.parallel.group import host_store, join, wait_for_ranks
from sloserve.parallel.worker import build_rank, enter_rank, launch, rank_device
from sloserve.sched.output import SchedulerOutput, StepResult

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # other nodes may start minutes apart
PING_EVERY_S = 5.0  # idle: how often check_health() makes sure remote ranks still answer
DEATH_GRACE_S = 1.0  # after a failed collective: how long to wait for a local worker's exit status


_OWN = frozenset({"runner", "group", "workers", "devices"})


class TensorParallelRunner:
    """Rank 0 of `config.parallel.tensor_parallel_size` ranks; everything not listed delegates to its runner."""

    def __init__(self, config: SloserveConfig) -> None:
        pc = config.parallel
        world = pc.tensor_parallel_size
        # NOTE: a size the model cannot split is refused before any worker starts
        check_divisible(load_spec(resolve_model_path(config.model.path)), world)
        device = enter_rank(config, 0)
        self._broken: str | None = None
        self._closing = False
        self._dead: dict[int, str] = {}
        addr = pc.master_addr
        store = host_store(addr, pc.master_port or 0, world, JOIN_TIMEOUT_S)
        local = range(1, pc.ranks_per_node)
        self.workers = dict(
            zip(
                local,
                launch(config, local, addr, store.port, JOIN_TIMEOUT_S, logging.getLogger().level),
                strict=True,
            )
        )
        for rank, proc in self.workers.items():
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True
            ).start()
        self.group = None
        try:
            wait_for_ranks(store, world, JOIN_TIMEOUT_S, check=self._raise_if_dead)
            self.group = join(0, world, device, store)
            self.runner = build_rank(config, self.group)
        except BaseException:
            self._stop_workers(timeout_s=2.0)
            if self.group is not None:
                self.group.close()
            raise
        self._last_command = time.monotonic()
        self.devices = [rank_device(config, r) for r in range(world)]
        log.info(
            "tensor parallel: %d ranks on %d node(s); node 0 runs ranks 0-%d (%s), pids %s",
            world,
            pc.nnodes,
            pc.ranks_per_node - 1,
            ", ".join(self.devices[: pc.ranks_per_node]),
            [p.pid for p in self.workers.values()],
        )

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:  # not set yet (a failed __init__): no delegation
            raise AttributeError(name)
        return getattr(self.runner, name)

    # ---- the capabilities the engine relies on, declared (rank 0's) -----------------------------
    runs_steps = True  # every rank runs the same run of decode steps

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def expert_stats(self) -> dict:
        """Rank 0's expert counters ({} for a dense model)."""
        return self.runner.expert_stats()

    # ---- the calls every rank runs ---------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        return self._everywhere("execute", out)

    def warmup(self) -> None:
        self._everywhere("warmup")

    def time_steps(
        self, shapes: list[tuple[int, int]], rounds: int = 4
    ) -> list[tuple[int, int, float]]:
        return self._everywhere("time_steps", shapes, rounds)

    def probe(self) -> None:
        self._everywhere("probe")

    def _everywhere(self, name: str, *args: Any) -> Any:
        """Send the call to the other ranks, then make it here."""
        if self._broken is not None:
            raise RuntimeError(f"tensor parallelism is down: {self._broken}")
        try:
            self.group.send((name, args))
            self._last_command = time.monotonic()
            return None if name == "ping" else getattr(self.runner, name)(*args)
        except Exception as exc:
            self._broken = (
                self._death(wait_s=DEATH_GRACE_S)
                or f"{name} failed on rank 0: {type(exc).__name__}: {exc}"
            )
            log.error("tensor parallelism is down: %s", self._broken)
            raise RuntimeError(f"tensor parallelism is down: {self._broken}") from exc

    # ---- supervision -------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise if a rank is gone: a local worker's exit is seen at once, a remote rank's by a ping."""
        if self._broken is not None:
            raise RuntimeError(f"tensor parallelism is down: {self._broken}")
        self._raise_if_dead()
        if time.monotonic() - self._last_command > PING_EVERY_S:
            self._everywhere("ping")  # the broadcast itself is the check; the other ranks ignore it

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            self._dead[rank] = f"rank {rank} (pid {proc.pid}) {how}"
            log.error("tensor-parallel %s", self._dead[rank])

    def _death(self, wait_s: float) -> str | None:
        deadline = time.monotonic() + wait_s
        while not self._dead and time.monotonic() < deadline and self.workers:
            time.sleep(0.02)
        return "; ".join(self._dead.values()) or None

    def _raise_if_dead(self) -> None:
        if self._dead:
            raise RuntimeError(f"tensor parallelism is down: {'; '.join(self._dead.values())}")

    # ---- inspection and shutdown -------------------------------------------------------------------
    def info(self) -> dict:
        info = dict(self.runner.info())
        info["tensor_parallel_size"] = self.group.size
        info["tensor_parallel_devices"] = self.devices
        info.update(self.group.timer.as_dict())
        return info

    def close(self) -> None:
        """Stop the other ranks (they leave their loop on "stop") and leave the group."""
        if self._closing:
            return
        self._closing = True
        if self._broken is None:
            try:
                self.group.send(("stop", ()))
            except Exception as exc:  # noqa: BLE001 - a rank already gone: nothing to stop there
                log.warning("tensor parallel: stop not delivered: %s", exc)
        self._stop_workers()
        self.group.close()

    def _stop_workers(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        deadline = time.monotonic() + timeout_s
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
