"""A live sloserve server in a child process (the real CLI, or an injection-capable twin).

The child's stderr (JSON log lines) is collected by a thread, so the bound port, the pool size
and the shutdown messages can be read back; RSS comes from /proc. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICE_NAME = "sloserve.v1.Sloserve"
FULL = os.environ.get("SLOSERVE_FULL") == "1"


# Servers started here may use --inject-faults, which `serve` refuses without this (tests only).
ALLOW_FAULTS = {"SLOSERVE_ALLOW_FAULT_INJECTION": "1"}


def count(ci: int, full: int) -> int:
    """The CI count, or the full one with SLOSERVE_FULL=1."""
    return full if FULL else ci


class ServerProcess:
    """`python -m sloserve.cli.main serve ...` (or `-m MODULE ...`) on 127.0.0.1, port picked by the OS."""

    def __init__(self, args: Sequence[str], *, module: str = "sloserve.cli.main",
                 env: dict[str, str] | None = None, startup_s: float = 180.0) -> None:
        self.argv = [sys.executable, "-m", module, *args]
        self.logs: list[dict] = []
        self.raw: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **ALLOW_FAULTS, **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            line = self.wait_log(lambda m: m.startswith("listening on "), startup_s)
            self.address = line.split()[2]  # 'listening on HOST:PORT (plaintext|TLS)...'
            self.host, port = self.address.rsplit(":", 1)
            self.port = int(port)
        except BaseException:
            self.kill()
            raise

    @classmethod
    def cli(cls, model: Path | str, *extra: str, **kw) -> ServerProcess:
        """The real `sloserve serve` on a free port, no metrics or HTTP port, JSON logs."""
        return cls(["serve", "--model", str(model), "--device", "cpu", "--port", "0",
                    "--metrics-port", "off", "--http-port", "off", "--log-format", "json", *extra], **kw)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            text = raw.decode(errors="replace").rstrip("\n")
            entry = None
            if text.startswith("{"):
                try:
                    entry = orjson.loads(text)
                except orjson.JSONDecodeError:
                    entry = None
            with self._cond:
                self.raw.append(text)
                if entry is not None:
                    self.logs.append(entry)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def messages(self) -> list[str]:
        with self._cond:
            return [str(e.get("msg", "")) for e in self.logs]

    def wait_log(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first log message matching `predicate`; raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for entry in self.logs:
                    if predicate(str(entry.get("msg", ""))):
                        return str(entry["msg"])
                left = deadline - time.monotonic()
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n" + "\n".join(self.raw[-30:]))
                if left <= 0:
                    raise TimeoutError("no matching server log line; last lines:\n" + "\n".join(self.raw[-30:]))
                self._cond.wait(min(left, 0.5))

    def wait_ready(self, timeout: float = 180.0, credentials: grpc.ChannelCredentials | None = None,
                   metadata: Sequence[tuple[str, str]] | None = None) -> None:
        """Poll readiness (health of the Sloserve service) until SERVING."""
        deadline = time.monotonic() + timeout
        with self.sync_channel(credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n" + "\n".join(self.raw[-30:]))
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                          timeout=5, metadata=metadata).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("server never became ready:\n" + "\n".join(self.raw[-30:]))
                time.sleep(0.1)

    def sync_channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        target = f"127.0.0.1:{self.port}"
        if credentials is not None:
            return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", "localhost")])
        return grpc.insecure_channel(target)

    def aio_channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
        target = f"127.0.0.1:{self.port}"
        if credentials is not None:
            return grpc.aio.secure_channel(target, credentials,
                                           options=[("grpc.ssl_target_name_override", "localhost")])
        return grpc.aio.insecure_channel(target)

    def pids(self) -> list[int]:
        """The server process and its descendants (the engine process among them)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                try:
                    todo += [int(c) for c in task.read_text().split()]
                except OSError:
                    pass
        return found

    def engine_pid(self, timeout: float = 60.0) -> int:
        """The engine process's pid, from the server's 'engine process started (pid N)' log line."""
        line = self.wait_log(lambda m: m.startswith("engine process started (pid "), timeout)
        return int(line.split("(pid ", 1)[1].rstrip(")"))

    def rss_bytes(self) -> int:
        """Resident set size of the server and its engine process (VmRSS from /proc, summed)."""
        total = 0
        for pid in self.pids():
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                continue  # ended meanwhile
            total += next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:")), 0)
        if not total:
            raise RuntimeError("no VmRSS for the server process")
        return total

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def health(self, service: str = "", metadata=None, credentials=None) -> int:
        with self.sync_channel(credentials) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10, metadata=metadata).status

    def info(self, metadata=None, credentials=None) -> pb.InfoResponse:
        with self.sync_channel(credentials) as channel:
            return pb_grpc.SloserveStub(channel).Info(pb.InfoRequest(), timeout=10, metadata=metadata)

    def wait_quiescent(self, timeout: float = 60.0, **kw) -> pb.EngineStats:
        """Poll Info until nothing waits or runs and every KV block and swap slot is free."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.info(**kw).stats
            if quiescent(stats):
                return stats
            if time.monotonic() > deadline:
                return stats  # the caller's assertion shows what is still held
            time.sleep(0.05)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired if it does not exit in time."""
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode


def watch_health(channel: grpc.aio.Channel, service: str, statuses: list[int]) -> asyncio.Task:
    """A task appending every status the health Watch stream reports for `service` until it ends."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))

    async def follow() -> None:
        try:
            async for reply in watch:
                statuses.append(reply.status)
        except grpc.aio.AioRpcError:
            pass

    return asyncio.create_task(follow())


def quiescent(stats: pb.EngineStats) -> bool:
    return (stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
            and stats.swap_blocks_free == stats.swap_blocks_total)


def describe(stats: pb.EngineStats) -> str:
    return (f"running={stats.running} waiting={stats.waiting} kv_free={stats.kv_blocks_free}/"
            f"{stats.kv_blocks_total} cached={stats.kv_blocks_cached} swap_free={stats.swap_blocks_free}/"
            f"{stats.swap_blocks_total} preemptions={stats.preemptions_total} "
            f"finished={stats.requests_finished_total} refusals={dict(stats.refusals)}")
