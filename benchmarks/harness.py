"""Shared benchmark plumbing: start a sloserve server in a subprocess, send load, read its peak RSS."""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import orjson
from sloserve.bench.client import LoadSpec, RunResult, connect, fetch_info, run_load, wait_ready
from sloserve.bench.workloads import WorkloadItem, default_workload, load_workload

RESULTS = Path(__file__).resolve().parent / "results"
LOGS = Path(tempfile.gettempdir())  # server logs of benchmark runs

# A server process built from the typed config (so the benchmark does not depend on CLI flags).
_LAUNCH = """
import sys
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.serve import main
mode, model, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
server = ServerConfig(host="127.0.0.1", port=port, metrics_port=None, grace_s=1.0)
if mode == "naive":
    config = SloserveConfig.naive(path=model)
    config.server = server
else:
    config = SloserveConfig(model=ModelConfig(path=model), server=server)
sys.exit(main(config))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


class ServerProcess:
    """A `sloserve` server in a child process: naive ('before') or full ('after') configuration."""

    def __init__(self, mode: str, model: str = "default", log_path: Path | None = None) -> None:
        if mode not in ("naive", "full"):
            raise ValueError(f"mode must be 'naive' or 'full', got {mode!r}")
        self.mode, self.port = mode, free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path or os.devnull, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, mode, model, str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self._gpu_peak: int | None = None
        self._sampling = threading.Event()
        if shutil.which("nvidia-smi"):
            threading.Thread(target=self._sample_gpu, daemon=True).start()

    def _sample_gpu(self) -> None:
        """Poll nvidia-smi for this process's device memory and keep the peak (GPU machines only)."""
        while not self._sampling.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip() == str(self.proc.pid) and mib.strip().isdigit():
                    self._gpu_peak = max(self._gpu_peak or 0, int(mib) * 2**20)

    def peak_device_bytes(self) -> int | None:
        """Peak device memory of the server process seen by nvidia-smi (None without a GPU)."""
        return self._gpu_peak

    def wait_ready(self, timeout_s: float = 600.0) -> dict:
        """Wait until the model is loaded (health SERVING); return Info. Fails fast if the process exits."""
        return run(self._wait_ready(timeout_s))

    async def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.mode} server exited with status {self.proc.returncode}; "
                                   f"see {self.log_path or 'its log'}")
            try:
                return await ready_info(self.target, 5.0)
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise

    def peak_rss_bytes(self) -> int | None:
        """Peak resident set size of the server process so far (VmHWM)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        self._sampling.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def ready_info(target: str, timeout_s: float = 600.0) -> dict:
    """Wait for the server's model to load; return its Info."""
    channel = await connect(target, timeout_s=timeout_s)
    try:
        await wait_ready(channel, timeout_s)
        return await fetch_info(channel)
    finally:
        await channel.close()


async def send(target: str, items: list[WorkloadItem], spec: LoadSpec) -> RunResult:
    channel = await connect(target)
    try:
        return await run_load(channel, items, spec)
    finally:
        await channel.close()


def arc_items(num_requests: int, seed: int, max_prompt_chars: int, max_tokens: int,
              workload: str | None = None) -> tuple[str, list[WorkloadItem]]:
    """The ARC trace (or synthetic ARC) sized for a CPU: short-enough prompts, capped outputs.

    Items are drawn in the workload's seeded order; those whose prompt is longer than
    max_prompt_chars are skipped (the byte-level default model has one token per character).
    """
    spec = workload or default_workload()
    items = [i for i in load_workload(spec, seed=seed) if len(i.prompt) <= max_prompt_chars]
    if not items:
        raise ValueError(f"no request of {spec} has a prompt of at most {max_prompt_chars} characters")
    items = [replace(i, max_tokens=min(i.max_tokens, max_tokens)) for i in items]
    return spec, [items[k % len(items)] for k in range(num_requests)]


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def run(coro):
    return asyncio.run(coro)


def now() -> float:
    return time.perf_counter()
