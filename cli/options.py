"""Engine and server flags shared by `serve`, `generate` and `info`, and the config they build."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import click
from sloserve.cli.common import CliError
from sloserve.config import (
    DEFAULT_SCHEDULER_STEPS,
    POLICIES,
    CacheConfig,
    GrpcConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SloserveConfig,
    parse_size,
)

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def engine_options(fn: Callable) -> Callable:
    """--model and the engine switches (model, cache, scheduler)."""
    decorators = [
        click.option(
            "--model",
            default="default",
            show_default=True,
            help="A Hugging Face checkpoint folder, or a built-in model: 'default' (3M Llama trained on "
            "ARC grids), 'default-random' / 'default-moe' (random weights).",
        ),
        click.option(
            "--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."
        ),
        click.option(
            "--dtype",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            help="Weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU).",
        ),
        click.option(
            "--attention-backend",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "reference", "sdpa", "flash", "triton"]),
            help="Attention kernel (auto picks the best available).",
        ),
        click.option(
            "--max-model-len",
            type=int,
            default=None,
            help="Context length [default: the checkpoint's].",
        ),
        click.option(
            "--enforce-eager/--compile",
            "enforce_eager",
            default=None,
            help="Run the decode step eagerly, or compile it: on a GPU, decode steps are captured in "
            "CUDA graphs per batch bucket at start-up unless --enforce-eager; on a CPU, --compile "
            "torch.compiles them [default: graphs on a GPU, eager on a CPU].",
        ),
        click.option(
            "--cpu-gemm",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "onednn", "blas"]),
            help="Dense projections of a float32 model on a CPU: oneDNN on weights packed at load (auto "
            "uses it where torch has it; the projections are then held twice), or torch's BLAS.",
        ),
        click.option(
            "--host-malloc",
            default="keep",
            show_default=True,
            type=click.Choice(["keep", "system"]),
            help="On a CPU, keep freed activation memory in the heap (glibc thresholds raised: no page "
            "faults per step, RSS stays at its peak), or leave malloc as it is.",
        ),
        click.option(
            "--grammar-cache",
            default=64,
            show_default=True,
            type=int,
            help="Structured output: compiled grammars the engine keeps (LRU), one per distinct "
            "schema, regex or grammar.",
        ),
        click.option(
            "--kv-pool-size",
            default=None,
            help="Bytes for the KV cache pool, e.g. 512MiB or 2GiB [default: suits the device].",
        ),
        click.option(
            "--block-size",
            default=None,
            type=int,
            help="Tokens per KV page [default: what the attention backend wants: 256 for flash-attn, else 16].",
        ),
        click.option(
            "--prefix-cache/--no-prefix-cache",
            default=True,
            show_default=True,
            help="Reuse the KV of prompt prefixes already computed.",
        ),
        click.option(
            "--memory-budget",
            default=None,
            help="Device bytes for MoE experts + KV pool + workspaces, e.g. 40GiB [default: on a GPU "
            "the memory fraction of what is free after the dense weights; on a CPU no limit]. "
            "When all experts and the minimum KV pool do not fit, only some experts stay resident.",
        ),
        click.option(
            "--expert-slots-per-layer",
            default=None,
            type=int,
            help="MoE: routed experts per layer kept on the device (the rest in host memory, copied "
            "in when routed to) [default: all, or what --memory-budget allows].",
        ),
        click.option(
            "--expert-memory",
            default=None,
            help="MoE: device bytes for resident experts, e.g. 8GiB (instead of --expert-slots-per-layer).",
        ),
        click.option(
            "--expert-preload/--no-expert-preload",
            default=True,
            show_default=True,
            help="MoE with partial residency: pin the most routed experts and prefetch each layer's "
            "predicted experts (off: load experts only when routed to).",
        ),
        click.option(
            "--policy",
            default="slo",
            show_default=True,
            type=click.Choice(list(POLICIES)),
            help="Who runs next: slo (steps composed from deadlines), priority (the request's "
            "integer priority, lower first, then arrival) or fifo (arrival order).",
        ),
        click.option(
            "--max-batch",
            default=64,
            show_default=True,
            type=int,
            help="Most requests running at once.",
        ),
        click.option(
            "--chunked-prefill/--no-chunked-prefill",
            default=True,
            show_default=True,
            help="Split long prompts across steps so decodes keep flowing.",
        ),
        click.option(
            "--deadline-steps/--no-deadline-steps",
            default=True,
            show_default=True,
            help="slo policy: compose each step from deadlines (who decodes, how big a prefill chunk).",
        ),
        click.option(
            "--slack-preemption/--no-slack-preemption",
            default=True,
            show_default=True,
            help="slo policy: preempt the running request with the most slack (off: the least urgent).",
        ),
        click.option(
            "--admission-control/--no-admission-control",
            default=True,
            show_default=True,
            help="Refuse early a request whose objectives cannot be met.",
        ),
        click.option(
            "--max-wait",
            "max_wait_s",
            default=2.0,
            show_default=True,
            type=float,
            help="Starvation bound, seconds: every request is offered a step after waiting this long.",
        ),
        click.option(
            "--finish-margin",
            default=0.05,
            show_default=True,
            type=float,
            help="slo policy: aim each end-to-end deadline this share of its objective early.",
        ),
        click.option(
            "--num-scheduler-steps",
            default=DEFAULT_SCHEDULER_STEPS,
            show_default=True,
            type=int,
            help="Decode steps run back to back per schedule while every running request "
            "decodes and none waits (the per-step scheduling and output work is paid "
            "once per run; tokens stream in runs of this many).",
        ),
        click.option(
            "--tensor-parallel-size",
            "-tp",
            default=1,
            show_default=True,
            type=int,
            help="Ranks the model is split over (one process each; gloo on a CPU, NCCL on GPUs).",
        ),
        click.option(
            "--nnodes",
            default=1,
            show_default=True,
            type=int,
            help="Machines the tensor-parallel ranks span (torchrun's convention).",
        ),
        click.option(
            "--node-rank",
            default=0,
            show_default=True,
            type=int,
            help="This machine's index among --nnodes: 0 serves; the others only run their ranks.",
        ),
        click.option(
            "--master-addr",
            default="127.0.0.1",
            show_default=True,
            help="Address of node 0, where the ranks meet (bind address on node 0).",
        ),
        click.option(
            "--master-port",
            default=None,
            type=int,
            help="Port on node 0 where the ranks meet [default: a free one; required with --nnodes > 1].",
        ),
    ]
    return functools.reduce(lambda f, d: d(f), reversed(decorators), fn)


def build_config(
    opts: dict[str, Any],
    server: ServerConfig | None = None,
    grpc: GrpcConfig | None = None,
) -> SloserveConfig:
    """SloserveConfig from the engine flags; every ValueError becomes a one-line CliError."""
    if not _DEVICE_RE.match(opts["device"]):
        raise CliError(f"--device must be auto, cpu, cuda or cuda:N, got {opts['device']!r}")
    sizes = {}
    for key, flag in (
        ("kv_pool_size", "--kv-pool-size"),
        ("memory_budget", "--memory-budget"),
        ("expert_memory", "--expert-memory"),
    ):
        try:
            sizes[key] = parse_size(opts[key]) if opts.get(key) is not None else None
        except ValueError as exc:
            raise CliError(f"{flag}: {exc}") from None
    try:
        return SloserveConfig(
            model=ModelConfig(
                path=opts["model"],
                device=opts["device"],
                dtype=opts["dtype"],
                attention_backend=opts["attention_backend"],
                max_model_len=opts["max_model_len"],
                enforce_eager=opts.get("enforce_eager"),
                cpu_gemm=opts.get("cpu_gemm", "auto"),
                host_malloc=opts.get("host_malloc", "keep"),
                grammar_cache=opts.get("grammar_cache", 64),
            ),
            cache=CacheConfig(
                block_size=opts["block_size"],
                kv_pool_bytes=sizes["kv_pool_size"],
                prefix_cache=opts["prefix_cache"],
                memory_budget_bytes=sizes["memory_budget"],
                expert_slots_per_layer=opts.get("expert_slots_per_layer"),
                expert_memory_bytes=sizes["expert_memory"],
                expert_preload=opts.get("expert_preload", True),
            ),
            scheduler=SchedulerConfig(
                policy=opts["policy"],
                max_batch=opts["max_batch"],
                chunked_prefill=opts["chunked_prefill"],
                deadline_steps=opts["deadline_steps"],
                slack_preemption=opts["slack_preemption"],
                admission_control=opts["admission_control"],
                max_wait_s=opts["max_wait_s"],
                finish_margin=opts["finish_margin"],
                num_scheduler_steps=opts.get("num_scheduler_steps", DEFAULT_SCHEDULER_STEPS),
            ),
            server=server or ServerConfig(),
            grpc=grpc or GrpcConfig(),
            parallel=ParallelConfig(
                tensor_parallel_size=opts.get("tensor_parallel_size", 1),
                nnodes=opts.get("nnodes", 1),
                node_rank=opts.get("node_rank", 0),
                master_addr=opts.get("master_addr", "127.0.0.1"),
                master_port=opts.get("master_port"),
            ),
        )
    except ValueError as exc:
        raise CliError(with_flag(str(exc))) from None


_FLAGS = (
    ("max batch", "--max-batch"),
    ("block_size", "--block-size"),
    ("max_model_len", "--max-model-len"),
    ("kv pool", "--kv-pool-size"),
    ("model path", "--model"),
    ("metrics port", "--metrics-port"),
    ("port must", "--port"),
    ("max tokens limit", "--max-tokens-limit"),
    ("max stop strings", "--max-stop-strings"),
    ("max stop string chars", "--max-stop-string-chars"),
    ("max stop token ids", "--max-stop-token-ids"),
    ("log format", "--log-format"),
    ("expert slots", "--expert-slots-per-layer"),
    ("expert memory", "--expert-memory"),
    ("memory budget", "--memory-budget"),
    ("max wait", "--max-wait"),
    ("finish margin", "--finish-margin"),
    ("num scheduler steps", "--num-scheduler-steps"),
    ("tensor parallel size", "--tensor-parallel-size"),
    ("nnodes", "--nnodes"),
    ("node rank", "--node-rank"),
    ("master port", "--master-port"),
    ("idle spin", "--idle-spin"),
    ("max logprobs", "--max-logprobs"),
    ("max n", "--max-n"),
    ("frontends", "--frontends"),
    ("grammar cache", "--grammar-cache"),
    ("tls ca", "--tls-ca"),
    ("metrics token", "--metrics-token"),
    ("metrics compat", "--metrics-compat"),
    ("max prompts per request", "--max-prompts-per-request"),
)


def with_flag(message: str) -> str:
    """Prefix a config error with the flag that sets the field, so the user knows what to change."""
    for needle, flag in _FLAGS:
        if message.startswith(needle):
            return f"{flag}: {message}"
    return message


def pop_engine_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the engine flags from a command's kwargs and return them."""
    names = (
        "model",
        "device",
        "dtype",
        "attention_backend",
        "max_model_len",
        "kv_pool_size",
        "block_size",
        "prefix_cache",
        "policy",
        "max_batch",
        "chunked_prefill",
        "enforce_eager",
        "cpu_gemm",
        "host_malloc",
        "grammar_cache",
        "memory_budget",
        "expert_slots_per_layer",
        "expert_memory",
        "expert_preload",
        "deadline_steps",
        "slack_preemption",
        "admission_control",
        "max_wait_s",
        "finish_margin",
        "num_scheduler_steps",
        "tensor_parallel_size",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
    )
    return {name: kwargs.pop(name) for name in names}


async def with_engine(config: SloserveConfig, body: Callable[[Any], Any]) -> Any:
    """Start an in-process engine, run `await body(engine)`, stop it; load errors become CliErrors."""
    from sloserve.engine import AsyncEngine  # imports torch: only when a command needs a model

    engine = AsyncEngine(config)
    try:
        try:
            await engine.start()
        except ValueError as exc:  # CheckpointError, a pool too small for the model, ...
            raise CliError(f"cannot load model {config.model.path!r}: {exc}") from None
        return await body(engine)
    finally:
        await engine.stop()


# GrpcConfig field -> (flag, type, help); defaults are GrpcConfig's
_GRPC_FLAGS = {
    "max_request_id_length": (
        "--grpc-max-request-id-length",
        int,
        "Longest request_id accepted, in characters (printable ASCII only).",
    ),
    "max_streams": (
        "--grpc-max-streams",
        int,
        "Stream calls open at once, server-wide; more are refused RESOURCE_EXHAUSTED.",
    ),
    "max_streams_per_connection": (
        "--grpc-max-streams-per-connection",
        int,
        "Concurrent calls on one "
        "connection (HTTP/2 MAX_CONCURRENT_STREAMS; more wait at the client).",
    ),
    "max_connections": (
        "--grpc-max-connections",
        int,
        "Connections open at once; more are closed at accept.",
    ),
    "max_requests_per_stream": (
        "--grpc-max-requests-per-stream",
        int,
        "Requests live on one Stream; more are refused RESOURCE_EXHAUSTED.",
    ),
    "stream_queue": (
        "--grpc-stream-queue",
        int,
        "Messages waiting to be written on one Stream before the "
        "server stops reading it (back-pressure).",
    ),
    "stream_stall_s": (
        "--grpc-stream-stall-timeout",
        float,
        "Seconds one write may wait for a client that "
        "reads nothing before its Stream ends RESOURCE_EXHAUSTED.",
    ),
    "stream_idle_s": (
        "--grpc-stream-idle-timeout",
        float,
        "Seconds a Stream may stay open with no live request "
        "and no message before it ends UNAVAILABLE (0: never).",
    ),
    "max_connection_idle_s": (
        "--grpc-max-connection-idle",
        float,
        "Seconds a connection with no call stays open (then GOAWAY; 0: forever).",
    ),
    "max_connection_age_s": (
        "--grpc-max-connection-age",
        float,
        "Seconds a connection may live (then GOAWAY; 0: forever).",
    ),
    "max_connection_age_grace_s": (
        "--grpc-max-connection-age-grace",
        float,
        "Seconds the calls of a connection past its age get to finish.",
    ),
    "keepalive_time_s": (
        "--grpc-keepalive-time",
        float,
        "Seconds between the server's pings on a quiet connection (finds dead peers).",
    ),
    "keepalive_timeout_s": (
        "--grpc-keepalive-timeout",
        float,
        "Seconds a ping may go unanswered before the connection is closed.",
    ),
    "min_ping_interval_s": (
        "--grpc-min-ping-interval",
        float,
        "Clients that ping more often than this without data are sent GOAWAY (too_many_pings).",
    ),
}


def grpc_options(fn: Callable) -> Callable:
    """The gRPC edge's limits (GrpcConfig), one flag each."""
    defaults = GrpcConfig()
    decorators = [
        click.option(
            flag,
            name,
            type=kind,
            default=getattr(defaults, name),
            show_default=True,
            metavar="SECONDS" if kind is float else None,
            help=text,
        )
        for name, (flag, kind, text) in _GRPC_FLAGS.items()
    ]
    return functools.reduce(lambda f, d: d(f), reversed(decorators), fn)


def pop_grpc_config(kwargs: dict[str, Any]) -> GrpcConfig:
    """Remove the gRPC flags from a command's kwargs; their GrpcConfig, or a CliError naming the flag."""
    values = {name: kwargs.pop(name) for name in _GRPC_FLAGS}
    try:
        return GrpcConfig(**values)
    except ValueError as exc:
        name, _, rest = str(exc).partition(" ")
        raise CliError(
            f"{_GRPC_FLAGS[name][0]} {rest}" if name in _GRPC_FLAGS else str(exc)
        ) from None
