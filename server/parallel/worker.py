"""Tensor-parallel ranks: how each is started, built, and run.

Every rank builds a ModelRunner on its shard (`build_rank`, the same on rank 0 and on the
others). Ranks > 0 then loop in `serve_commands`: receive a command from rank 0 (a runner method
and its plain-data arguments), call it, repeat; their forwards meet rank 0's in the all-reduces.
A worker is a process of its own, started with `launch` as ``python -m sloserve.parallel.worker``
(the config arrives pickled on stdin), by rank 0's engine for its node's ranks and by
``sloserve serve --node-rank K`` for the ranks of node K.

A worker ignores SIGINT and SIGTERM (the engine owns shutdown and sends "stop") and exits when
its parent does; any error ends it, and rank 0 notices at once: its next collective fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import torch
from sloserve.config import SloserveConfig
from sloserve.executor.runner import ModelRunner
from sloserve.models.shard import Shard
from sloserve.parallel.group import RankGroup, join

log = logging.getLogger("sloserve.parallel.worker")  # NOTE: also when run as __main__


def rank_device(config: SloserveConfig, rank: int) -> str:
    """The device string of `rank`: its node-local GPU (cuda:base+local rank) or the CPU."""
    name = config.model.device
    local = rank % config.parallel.ranks_per_node
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return "cpu"
    base = int(name.split(":")[1]) if ":" in name else 0
    return f"cuda:{base + local}"


def rank_config(config: SloserveConfig, rank: int) -> SloserveConfig:
    """`config` with the model placed on `rank`'s device."""
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, device=rank_device(config, rank))
    )


def cpu_threads(config: SloserveConfig) -> int:
    """Threads per rank on a CPU: the node's cores shared by its ranks (oversubscribing stalls every rank)."""
    return max(1, (os.cpu_count() or 1) // config.parallel.ranks_per_node)


def enter_rank(config: SloserveConfig, rank: int) -> torch.device:
    """This rank's device; on a CPU, torch's thread count set to the rank's share of the node's cores."""
    device = torch.device(rank_device(config, rank))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(config))
    return device


def build_rank(config: SloserveConfig, group: RankGroup) -> ModelRunner:
    """This rank's runner, once every rank has built its own: raises (on every rank) if any failed.

    The ranks then agree on the KV pool: the fewest blocks any rank holds (one block manager on
    rank 0 hands out block ids that every rank must have).
    """
    config = rank_config(config, group.rank)
    runner, status = None, None
    try:
        runner = ModelRunner(config, Shard(group.rank, group.size), group.reduce)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they would wait forever
        status = f"{type(exc).__name__}: {exc}"
        log.error("tensor-parallel rank %d failed to load: %s", group.rank, status)
    statuses = group.gather(status)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        rank, reason = failed[0]
        raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reason}")
    assert runner is not None
    counts = group.gather((runner.num_kv_blocks, runner.num_host_blocks))
    runner.num_kv_blocks = min(kv for kv, _ in counts)
    runner.num_host_blocks = min(host for _, host in counts)
    return runner


def serve_commands(runner: ModelRunner, group: RankGroup) -> None:
    """Ranks > 0: run rank 0's commands until "stop"."""
    while True:
        name, args = group.receive()
        if name == "stop":
            return
        if name != "ping":
            getattr(runner, name)(*args)  # only rank 0's results reach the engine


def run_worker(config: SloserveConfig, rank: int, addr: str, port: int, timeout_s: float) -> None:
    """Entry point of one rank > 0."""
    world = config.parallel.tensor_parallel_size
    device = enter_rank(config, rank)
    group = join(rank, world, device, addr=addr, port=port, timeout_s=timeout_s)
    try:
        runner = build_rank(config, group)
        log.info(
            "tensor-parallel rank %d of %d ready on %s (pid %d)", rank, world, device, os.getpid()
        )
        serve_commands(runner, group)
    finally:
        group.close()


def launch(
    config: SloserveConfig,
    ranks: range,
    addr: str,
    port: int,
    timeout_s: float,
    log_level: int = logging.INFO,
) -> list[subprocess.Popen]:
    """Start one worker process per rank in `ranks`, each told the master's address and port."""
    payload = pickle.dumps(config)
    workers = []
    for rank in ranks:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sloserve.parallel.worker",
                "--rank",
                str(rank),
                "--addr",
                addr,
                "--port",
                str(port),
                "--timeout",
                str(timeout_s),
                "--log-level",
                str(log_level),
            ],
            stdin=subprocess.PIPE,
        )
        proc.stdin.write(payload)
        proc.stdin.close()
        workers.append(proc)
    return workers


def _die_with_parent(every_s: float = 0.5) -> None:
    """Exit when the process that started this worker is gone (checked by a thread: PR_SET_PDEATHSIG
    would follow the starting *thread*, and the engine may start workers from a pool thread)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sloserve.parallel.worker",
        description="One tensor-parallel rank (started by sloserve; config on stdin).",
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = pickle.loads(sys.stdin.buffer.read())
    from sloserve.logs import configure_logging

    configure_logging(config.server.log_format, level=args.log_level)
    try:
        run_worker(config, args.rank, args.addr, args.port, args.timeout)
    except Exception as exc:  # noqa: BLE001 - rank 0 sees the collective fail; the log says why
        log.error("tensor-parallel rank %d stopped: %s: %s", args.rank, type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
