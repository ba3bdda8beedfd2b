"""A live sloserve server in a child process, for tests and benchmarks alike.

ServerProcess is the product's LocalServer (`sloserve bench compare` starts one per point) plus
what a test or a benchmark reads back: the log lines (from its log file, parsed when they are
JSON), readiness with TLS or a token, Info and health, the process tree's pids, RSS, CPU time and
peaks. Every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sloserve.bench.client import info_fields
from sloserve.bench.local_server import LocalServer
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.procfs import cpu_seconds, process_tree, vm_bytes

SERVICE_NAME = "sloserve.v1.Sloserve"
SLOSERVE = (sys.executable, "-m", "sloserve.cli.main")
# `sloserve` whose `serve` takes --inject-faults (sloserve.testing.serve_faults): for a server a test
# injects faults into; it refuses them without ALLOW_FAULTS, which servers started here get.
WITH_FAULTS = (sys.executable, "-m", "sloserve.testing.serve_faults")
ALLOW_FAULTS = {"SLOSERVE_ALLOW_FAULT_INJECTION": "1"}


class ServerProcess(LocalServer):
    """`command *args` (default `python -m sloserve.cli.main`) on 127.0.0.1.

    port: the port the arguments make it serve on; None when they say `--port 0`, and the port
    is read from its 'listening on HOST:PORT' JSON log line. log_path: where its output goes (a
    temporary file, removed on stop, when None). sample_gpu: poll nvidia-smi for its device memory.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        command: Sequence[str] = SLOSERVE,
        port: int | None = None,
        log_path: Path | None = None,
        label: str = "server",
        env: Mapping[str, str] | None = None,
        startup_s: float = 180.0,
        sample_gpu: bool = False,
    ) -> None:
        self.argv = [*command, *args]
        self._temporary_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="sloserve-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self._lines = LogLines(log_path)
        super().__init__(
            self.argv,
            port or 0,
            log_path,
            label,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **ALLOW_FAULTS, **(env or {})},
        )
        self._gpu_peak: int | None = None
        self._sampling = threading.Event()
        if sample_gpu and shutil.which("nvidia-smi"):
            threading.Thread(target=self._sample_gpu, daemon=True).start()
        if port is None:
            try:
                line = self.wait_log(lambda m: m.startswith("listening on "), startup_s)
                self.address = line.split()[2]  # 'listening on HOST:PORT (plaintext|TLS)...'
                self.host, port_text = self.address.rsplit(":", 1)
                self.port, self.target = int(port_text), f"127.0.0.1:{port_text}"
            except BaseException:
                self.kill()
                raise

    @classmethod
    def cli(cls, model: Path | str, *extra: str, **kw) -> ServerProcess:
        """The real `sloserve serve` on a free port, no metrics or HTTP port, JSON logs."""
        return cls(
            [
                "serve",
                "--model",
                str(model),
                "--device",
                "cpu",
                "--port",
                "0",
                "--metrics-port",
                "off",
                "--http-port",
                "off",
                "--log-format",
                "json",
                *extra,
            ],
            **kw,
        )

    @property
    def logs(self) -> list[dict]:
        """Every JSON log line so far, parsed."""
        return self._lines.read()[1]

    @property
    def raw(self) -> list[str]:
        """Every output line so far."""
        return self._lines.read()[0]

    def messages(self) -> list[str]:
        return [str(e.get("msg", "")) for e in self.logs]

    def _tail(self) -> str:
        return "\n".join(self.raw[-30:])

    def wait_log(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first log message matching `predicate`; raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            # before reading, so no line written before the exit is missed
            exited = self.proc.poll() is not None
            for entry in self.logs:
                if predicate(str(entry.get("msg", ""))):
                    return str(entry["msg"])
            if exited:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no matching server log line; last lines:\n{self._tail()}")
            time.sleep(0.02)

    def wait_http_port(self, timeout: float = 30.0) -> int:
        """The HTTP API's port, from the 'http listening on HOST:PORT' log line (`--http-port auto`)."""
        line = self.wait_log(lambda m: m.startswith("http listening on "), timeout)
        return int(line.split()[3].rsplit(":", 1)[1])

    def wait_ready(
        self,
        timeout: float = 180.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> dict:
        """Poll readiness (health of the Sloserve service) until SERVING; return Info as
        sloserve.bench.client.fetch_info gives it."""
        deadline = time.monotonic() + timeout
        with self.sync_channel(credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode}:\n{self._tail()}"
                    )
                try:
                    status = health.Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                        timeout=5,
                        metadata=metadata,
                    ).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return info_fields(
                            pb_grpc.SloserveStub(channel).Info(
                                pb.InfoRequest(), timeout=10, metadata=metadata
                            )
                        )
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server never became ready:\n{self._tail()}")
                time.sleep(0.1)

    def sync_channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        if credentials is not None:
            return grpc.secure_channel(
                self.target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
            )
        return grpc.insecure_channel(self.target)

    def aio_channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
        if credentials is not None:
            return grpc.aio.secure_channel(
                self.target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
            )
        return grpc.aio.insecure_channel(self.target)

    def pids(self) -> list[int]:
        """The server process and its descendants (the engine process among them)."""
        return process_tree(self.proc.pid)

    def engine_pid(self, timeout: float = 60.0) -> int:
        """The engine process's pid, from the server's 'engine process started (pid N)' log line."""
        line = self.wait_log(lambda m: m.startswith("engine process started (pid "), timeout)
        return int(line.split("(pid ", 1)[1].rstrip(")"))

    def rss_bytes(self) -> int:
        """Resident set size of the server and its descendants (VmRSS from /proc, summed)."""
        total = sum(vm_bytes(pid, "VmRSS:") or 0 for pid in self.pids())
        if not total:
            raise RuntimeError("no VmRSS for the server process")
        return total

    def peak_rss_bytes(self) -> int | None:
        """Peak resident set size (VmHWM) of the server process plus its descendants (the engine
        process): the sum of each one's own peak, an upper bound on the tree's peak at one moment."""
        peaks = [hwm for pid in self.pids() if (hwm := vm_bytes(pid, "VmHWM:")) is not None]
        return sum(peaks) if peaks else None

    def peak_device_bytes(self) -> int | None:
        """Peak device memory of the server process seen by nvidia-smi (None without sample_gpu or a GPU)."""
        return self._gpu_peak

    def _sample_gpu(self) -> None:
        """Poll nvidia-smi for this process's device memory and keep the peak."""
        while not self._sampling.wait(0.5):
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip() == str(self.proc.pid) and mib.strip().isdigit():
                    self._gpu_peak = max(self._gpu_peak or 0, int(mib) * 2**20)

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used so far."""
        return cpu_seconds([self.proc.pid])

    def health(self, service: str = "", metadata=None, credentials=None) -> int:
        with self.sync_channel(credentials) as channel:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=10, metadata=metadata
                )
                .status
            )

    def info(self, metadata=None, credentials=None) -> pb.InfoResponse:
        with self.sync_channel(credentials) as channel:
            return pb_grpc.SloserveStub(channel).Info(
                pb.InfoRequest(), timeout=10, metadata=metadata
            )

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
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL (and TimeoutExpired) if it does not exit in time. The exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.kill()
                    raise
            return self.proc.returncode
        finally:
            self._close()

    def _close(self) -> None:
        self._sampling.set()
        self._log.close()
        if self._temporary_log and self.log_path is not None:
            self._lines.read()  # keep the last lines readable
            self.log_path.unlink(missing_ok=True)


class LogLines:
    """A log file read as it grows: every complete line, and those that are JSON parsed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._raw: list[str] = []
        self._parsed: list[dict] = []
        self._lock = threading.Lock()

    def read(self) -> tuple[list[str], list[dict]]:
        """(every line, every JSON line parsed) so far; copies, safe to keep."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""  # removed on stop: what was read stays
            self._offset += len(data)
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                self._raw.append(text)
                if text.startswith("{"):
                    try:
                        self._parsed.append(orjson.loads(text))
                    except orjson.JSONDecodeError:
                        pass
            return list(self._raw), list(self._parsed)


def quiescent(stats: pb.EngineStats) -> bool:
    return (
        stats.running == 0
        and stats.waiting == 0
        and stats.kv_blocks_free == stats.kv_blocks_total
        and stats.swap_blocks_free == stats.swap_blocks_total
    )


def describe(stats: pb.EngineStats) -> str:
    return (
        f"running={stats.running} waiting={stats.waiting} kv_free={stats.kv_blocks_free}/"
        f"{stats.kv_blocks_total} cached={stats.kv_blocks_cached} swap_free={stats.swap_blocks_free}/"
        f"{stats.swap_blocks_total} preemptions={stats.preemptions_total} "
        f"finished={stats.requests_finished_total} refusals={dict(stats.refusals)}"
    )
