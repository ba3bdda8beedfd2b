"""Shared benchmark plumbing: start a sloserve server in a subprocess, send load, read its peak RSS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import grpc
import orjson
from sloserve.bench.client import LoadSpec, RunResult, connect
from sloserve.bench.local_server import free_port, ready_info, send_load  # noqa: F401 - the scripts use ready_info
from sloserve.bench.workloads import WorkloadItem, default_workload, load_workload
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import ServerProcess

from benchmarks._output import OUT

LOGS = Path(tempfile.gettempdir())  # server logs of benchmark runs

OVERRIDE_SECTIONS = ("scheduler", "cache", "model", "server")


def launch_config(
    mode: str, model: str, port: int, overrides: dict | None = None
) -> SloserveConfig:
    """The config of a benchmark server: naive or full, then the overrides applied
    ({"scheduler": {field: value}, "cache": {...}, "model": {...}, "server": {...}}, validated by
    the dataclasses; the model's path and the server's address stay the run's own)."""
    config = (
        SloserveConfig.naive(path=model)
        if mode == "naive"
        else SloserveConfig(model=ModelConfig(path=model))
    )
    config.server = ServerConfig(host="127.0.0.1", port=port, metrics_port=None, grace_s=1.0)
    for section, values in (overrides or {}).items():
        setattr(config, section, replace(getattr(config, section), **values))
    return config


def check_overrides(overrides: dict | None) -> dict:
    """Validate {"scheduler": {...}, "cache": {...}, "model": {...}, "server": {...}} against this
    build's config classes.

    ValueError names an unknown section or field (a switch this build does not have yet) or a bad
    value, before a server is launched.
    """
    classes = {
        "scheduler": SchedulerConfig,
        "cache": CacheConfig,
        "model": ModelConfig,
        "server": ServerConfig,
    }
    for section, values in (overrides or {}).items():
        if section not in classes:
            raise ValueError(
                f"override section must be one of {', '.join(OVERRIDE_SECTIONS)}, got {section!r}"
            )
        if section == "model" and "path" in values:
            raise ValueError("the model path is the run's own (--model), not an override")
        if section == "server" and {"host", "port", "metrics_port"} & set(values):
            raise ValueError("the server's address is the run's own, not an override")
        known = {f.name for f in fields(classes[section])}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"{section} config of this build has no field {', '.join(unknown)}")
        classes[section](**values)  # the dataclass validates the values
    return dict(overrides or {})


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def launch(
    mode: str, model: str = "default", log_path: Path | None = None, overrides: dict | None = None
) -> ServerProcess:
    """A `sloserve` server in a child process: naive ('before') or full ('after') configuration,
    with optional config overrides (see check_overrides), so any arm or ablation is one launch."""
    if mode not in ("naive", "full"):
        raise ValueError(f"mode must be 'naive' or 'full', got {mode!r}")
    overrides, port = check_overrides(overrides), free_port()
    return ServerProcess(
        [mode, model, str(port), json.dumps(overrides)],
        command=(sys.executable, "-m", "benchmarks._launch"),
        port=port,
        log_path=log_path,
        label=f"{mode} server",
        sample_gpu=True,
    )


send = send_load  # (target, items, spec) -> RunResult


def bench_fresh_server(
    sloserve: Path, serve_args: list[str], bench_args: list[str], log_path: Path
) -> dict:
    """One fresh `SLOSERVE serve SERVE_ARGS` on free ports, one `SLOSERVE bench BENCH_ARGS` run
    against its gRPC port, the server stopped: the bench report's first run (its JSON schema:
    sloserve.bench.report). Only the command line is used, so any build's `sloserve` serves."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    ports = ["--port", str(grpc_port), "--http-port", str(http_port)]
    serve = [str(sloserve), "serve", *serve_args, *ports, "--metrics-port", str(metrics_port)]
    report = log_path.with_name(f"bench_{time.monotonic_ns()}.json")
    bench = [str(sloserve), "bench", "--server", f"127.0.0.1:{grpc_port}", *bench_args]
    with open(log_path, "a") as log:
        server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
        try:
            subprocess.run(
                [*bench, "--json", str(report)], check=True, capture_output=True, timeout=1800
            )
        finally:
            server.terminate()
            server.wait(timeout=60)
    return json.loads(report.read_text())["runs"][0]


def message_dict(message) -> dict:
    """Every field of a protobuf message by name (maps as dicts, enums by name). A field this
    build's stubs lack is simply absent, so `.get(name)` is None until it lands."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = dict(value)
        elif f.message_type is not None:
            value = message_dict(value)
        elif f.enum_type is not None:
            value = (
                f.enum_type.values_by_number[value].name
                if value in f.enum_type.values_by_number
                else value
            )
        elif not isinstance(value, int | float | str | bool | bytes):
            value = list(value)  # a repeated scalar
        out[f.name] = value
    return out


async def engine_info(target: str) -> dict:
    """The server's InfoResponse with its engine counters (`stats`), as message_dict gives it."""
    channel = await connect(target)
    try:
        return message_dict(
            await pb_grpc.SloserveStub(channel).Info(pb.InfoRequest(), timeout=10.0)
        )
    finally:
        await channel.close()


@dataclass(slots=True)
class Peaks:
    """What an Info poller saw during a run (sampled, so a lower bound on the true peaks)."""

    running: int = 0  # most requests running at once
    # most KV blocks in use at once: total - free (cached free blocks are free)
    blocks_in_use: int = 0
    samples: int = 0


async def _poll(target: str, peaks: Peaks, every_s: float, stop: asyncio.Event) -> None:
    channel = await connect(target)
    stub = pb_grpc.SloserveStub(channel)
    try:
        while not stop.is_set():
            try:
                stats = (await stub.Info(pb.InfoRequest(), timeout=5.0)).stats
            except grpc.aio.AioRpcError:
                pass
            else:
                peaks.samples += 1
                peaks.running = max(peaks.running, stats.running)
                peaks.blocks_in_use = max(
                    peaks.blocks_in_use, stats.kv_blocks_total - stats.kv_blocks_free
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    finally:
        await channel.close()


async def send_sampled(
    target: str, items: list[WorkloadItem], spec: LoadSpec, every_s: float = 0.1
) -> tuple[RunResult, Peaks]:
    """send(), polling the server's Info every every_s seconds for the peak batch and KV use."""
    peaks, stop = Peaks(), asyncio.Event()
    poller = asyncio.create_task(_poll(target, peaks, every_s, stop))
    try:
        return await send(target, items, spec), peaks
    finally:
        stop.set()
        await poller


def arc_pool(
    seed: int, max_prompt_chars: int, max_tokens: int, workload: str | None = None
) -> tuple[str, list[WorkloadItem]]:
    """The ARC trace (or synthetic ARC) sized for a CPU, each request once: prompts of at most
    max_prompt_chars (one token per character with the byte-level default model), outputs the
    trace's answer lengths capped at max_tokens, in the workload's seeded order."""
    spec = workload or default_workload()
    items = [i for i in load_workload(spec, seed=seed) if len(i.prompt) <= max_prompt_chars]
    if not items:
        raise ValueError(
            f"no request of {spec} has a prompt of at most {max_prompt_chars} characters"
        )
    return spec, [replace(i, max_tokens=min(i.max_tokens, max_tokens)) for i in items]


def arc_items(
    num_requests: int,
    seed: int,
    max_prompt_chars: int,
    max_tokens: int,
    workload: str | None = None,
) -> tuple[str, list[WorkloadItem]]:
    """arc_pool's requests, repeated from the start when more are asked for than it holds."""
    spec, items = arc_pool(seed, max_prompt_chars, max_tokens, workload)
    return spec, [items[k % len(items)] for k in range(num_requests)]


def take(pool: list[WorkloadItem], start: int, n: int) -> list[WorkloadItem]:
    """n requests from pool[start:] (repeating from the start only when n exceeds the pool)."""
    return [pool[(start + k) % len(pool)] for k in range(n)]


def save(name: str, payload: dict) -> Path:
    """payload as benchmarks/out/NAME.json."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_bytes(
        orjson.dumps(
            payload,
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
        )
    )
    return path


def run(coro):
    return asyncio.run(coro)


def now() -> float:
    return time.perf_counter()
