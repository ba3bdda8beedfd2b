"""A sloserve server in a child process on 127.0.0.1 (a free port), started for a measurement and
stopped after it: `sloserve bench compare` and the benchmark scripts start one per point."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from sloserve.bench.client import LoadSpec, RunResult, connect, fetch_info, run_load, wait_ready
from sloserve.bench.record import RequestRecord
from sloserve.bench.workloads import WorkloadItem


def free_port() -> int:
    """A port the OS reports free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sloserve_argv(*args: str) -> list[str]:
    """The command line of `sloserve ARGS` run by this interpreter."""
    return [sys.executable, "-m", "sloserve.cli.main", *args]


async def ready_info(target: str, timeout_s: float = 600.0) -> dict:
    """Wait for the server's model to load; return its Info."""
    channel = await connect(target, timeout_s=timeout_s)
    try:
        await wait_ready(channel, timeout_s)
        return await fetch_info(channel)
    finally:
        await channel.close()


class LocalServer:
    """A child process serving gRPC on 127.0.0.1:port, its output to log_path (or nowhere)."""

    def __init__(
        self,
        argv: Sequence[str],
        port: int,
        log_path: Path | None = None,
        label: str = "server",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port, self.target, self.label, self.log_path = (
            port,
            f"127.0.0.1:{port}",
            label,
            log_path,
        )
        self._log = open(log_path or os.devnull, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
        )

    @classmethod
    def serve(
        cls,
        model: str,
        serve_args: Sequence[str] = (),
        log_path: Path | None = None,
        label: str = "server",
    ) -> LocalServer:
        """`sloserve serve --model model *serve_args` on a free port, gRPC only, grace of 1 s."""
        port = free_port()
        argv = sloserve_argv(
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            "off",
            "--http-port",
            "off",
            "--grace",
            "1",
            *serve_args,
        )
        return cls(argv, port, log_path, label)

    def wait_ready(self, timeout_s: float = 600.0) -> dict:
        """Wait until the model is loaded (health SERVING); return Info. Fails fast if the process exits."""
        return asyncio.run(self._wait_ready(timeout_s))

    async def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the {self.label} exited with status {self.proc.returncode}; "
                    f"see {self.log_path or 'its log'}"
                )
            try:
                return await ready_info(self.target, 5.0)
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise

    def stop(self) -> None:
        """SIGTERM (a graceful drain), then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def send_load(
    target: str,
    items: list[WorkloadItem],
    spec: LoadSpec,
    progress: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """One run of `items` as `spec` says against the server at target."""
    channel = await connect(target)
    try:
        return await run_load(channel, items, spec, progress)
    finally:
        await channel.close()
