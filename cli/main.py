"""The `sloserve` command: serve, generate, info (and bench, the load generator)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import click
import grpc
import orjson
from sloserve import __version__
from sloserve.cli.common import (
    RANDOM_MODELS,
    RANDOM_WEIGHTS_NOTE,
    CliError,
    OneLineCommand,
    check_model,
    client_options,
    metadata,
    open_channel,
    parse_server,
    read_token,
    remote_or_local_option,
    rpc_error,
)
from sloserve.cli.generate import generate
from sloserve.cli.options import (
    build_config,
    config_options,
    engine_options,
    pop_config,
    with_engine,
)
from sloserve.config import GrpcConfig, ServerConfig
from sloserve.http.config import HttpConfig
from sloserve.openmp import default_waiting


# Every flag can also come from the environment: SLOSERVE_<COMMAND>_<FLAG>, e.g. SLOSERVE_SERVE_HTTP_PORT=8080
# (click's auto_envvar_prefix; a flag given on the command line wins). SLOSERVE_AUTH_TOKEN keeps its name.
@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "SLOSERVE"}
)
@click.version_option(__version__, prog_name="sloserve", allow_from_autoenv=False)
def cli() -> None:
    """sloserve: an SLO-aware LLM inference server with bidirectional gRPC token streaming.

    Every flag can also be set as SLOSERVE_<COMMAND>_<FLAG> (SLOSERVE_SERVE_MODEL=/models/qwen).
    """
    default_waiting()  # OpenMP's wait between parallel regions, before torch loads (sloserve/openmp.py)


def _http_port(text: str) -> int | None:
    """--http-port: a port, 'auto' (the OS picks a free one: 0 internally), or 'off'/'0' (no HTTP)."""
    lowered = text.lower()
    if lowered in ("off", "0"):
        return None
    if lowered == "auto":
        return 0
    if not text.isdigit() or int(text) > 65535:
        raise CliError(
            f"--http-port must be a port in 1..65535, 'auto' or 'off' (or 0), got {text!r}"
        )
    return int(text)


@cli.command(cls=OneLineCommand)
@engine_options
@config_options(ServerConfig, HttpConfig, GrpcConfig)
@click.option(
    "--http-port",
    default="8000",
    show_default=True,
    help="OpenAI-compatible HTTP API port; 'auto' picks a free one; 'off' or 0 serves gRPC only.",
)
@click.option("--auth-token-file", default=None, help="Read the bearer token from this file.")
def serve(make_core=None, **kwargs) -> None:
    """Serve a model over gRPC and an OpenAI-compatible HTTP API until SIGTERM/SIGINT (then drain, exit 0)."""
    # NOTE: `make_core` is no flag: python -m sloserve.testing.serve_faults passes a fault-injecting core
    check_model(kwargs["model"])
    token = kwargs["auth_token"] = read_token(kwargs["auth_token"], kwargs.pop("auth_token_file"))
    for flag in ("tls_cert", "tls_key", "tls_ca", "chat_template"):
        path = kwargs[flag]
        if path is not None and not Path(path).is_file():
            raise CliError(f"--{flag.replace('_', '-')} {path!r} is not a readable file")
    port = _http_port(kwargs.pop("http_port"))
    config = build_config(kwargs)
    server = config.server
    http = pop_config(kwargs, HttpConfig, model_name=server.served_model_name)
    http = None if port is None else dataclasses.replace(http, port=port)
    if config.parallel.node_rank > 0:
        sys.exit(_serve_node(config))
    click.echo(
        f"sloserve {__version__}: serving {config.model.path!r} on {server.host}:{server.port}"
        f" ({'mTLS' if server.tls_ca else 'TLS' if server.tls_cert else 'plaintext'}, "
        f"auth {'on' if token else 'off'})"
        + (f", HTTP on {server.host}:{http.port or 'auto'}" if http else ", HTTP off"),
        err=True,
    )
    if config.model.path in RANDOM_MODELS:
        click.echo(RANDOM_WEIGHTS_NOTE.format(model=config.model.path), err=True)
    from sloserve.serve import main as serve_main

    try:
        code = serve_main(config, http=http, make_core=make_core)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    sys.exit(code)


def _serve_node(config) -> int:
    """--node-rank K > 0: this machine only runs its tensor-parallel ranks (node 0 serves)."""
    from sloserve.parallel.node import node_ranks, serve_node

    pc = config.parallel
    ranks = node_ranks(config)
    click.echo(
        f"sloserve {__version__}: node {pc.node_rank} of {pc.nnodes} runs tensor-parallel ranks "
        f"{ranks.start}-{ranks.stop - 1} of {pc.tensor_parallel_size}, meeting node 0 at "
        f"{pc.master_addr}:{pc.master_port}",
        err=True,
    )
    try:
        return serve_node(config)
    except ValueError as exc:
        raise CliError(f"cannot load model {config.model.path!r}: {exc}") from None


INFO_KEYS = (
    "model",
    "architecture",
    "version",
    "device",
    "dtype",
    "dtype_reason",
    "weight_resident_bytes",
    "quantization",
    "attention_backend",
    "max_model_len",
    "max_prompt_tokens",
    "max_tokens_limit",
    "block_size",
    "kv_cache_dtype",
    "kv_tokens",
    "expert_residency",
    "num_experts",
    "expert_slots_per_layer",
    "expert_device_bytes",
    "tensor_parallel_size",
    "tensor_parallel_devices",
)


@cli.command(cls=OneLineCommand)
@remote_or_local_option
@engine_options
@client_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(server, auth_token, tls_ca, tls_cert, tls_key, timeout, as_json, **kwargs) -> None:
    """Server state (loading, serving, draining, engine_dead), model, limits and live engine statistics."""
    if server is not None:
        data = asyncio.run(
            _remote_info(parse_server(server), auth_token, (tls_ca, tls_cert, tls_key), timeout)
        )
    else:
        check_model(kwargs["model"])
        data = asyncio.run(with_engine(build_config(kwargs), _local_info))
    if as_json:
        click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    width = max(map(len, data))
    for key, value in data.items():
        click.echo(f"{key:<{width}}  {value}")


async def _remote_info(
    server: str, token: str | None, tls: tuple[str | None, str | None, str | None], timeout: float
) -> dict:
    from google.protobuf.json_format import MessageToDict
    from sloserve.pb import serving_pb2 as pb
    from sloserve.pb import serving_pb2_grpc as pb_grpc

    channel = await open_channel(server, tls[0], timeout, tls[1], tls[2])
    try:
        reply = await pb_grpc.SloserveStub(channel).Info(
            pb.InfoRequest(), metadata=metadata(token), timeout=timeout
        )
    except grpc.aio.AioRpcError as exc:
        raise rpc_error(exc, server) from None
    finally:
        await channel.close()
    data = {"state": pb.ServerState.Name(reply.state).removeprefix("SERVER_STATE_").lower()}
    data.update((key, getattr(reply, key)) for key in INFO_KEYS)
    data["tensor_parallel_devices"] = list(reply.tensor_parallel_devices)
    stats = MessageToDict(
        reply.stats, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    for key, value in stats.items():  # uint64 fields arrive as strings in proto JSON
        data[key] = int(value) if isinstance(value, str) and value.isdigit() else value
    return data


async def _local_info(engine) -> dict:
    from dataclasses import asdict

    model_info = dict(engine.model_info)
    data: dict = {"state": "serving" if engine.ready else "loading"}
    data.update((key, model_info.get(key)) for key in INFO_KEYS if key in model_info)
    data["model"] = model_info.get("model", data.get("model"))
    data["version"] = __version__
    stats = engine.stats()
    data.update(asdict(stats) if hasattr(stats, "__dataclass_fields__") else dict(vars(stats)))
    return data


cli.add_command(generate)
try:  # the load generator lives in its own module (it pulls in matplotlib lazily)
    from sloserve.cli.bench import bench
except ImportError:  # pragma: no cover - only while the bench module is missing
    bench = None
if bench is not None:
    cli.add_command(bench)

if __name__ == "__main__":
    cli()
