"""The `sloserve` command: serve, generate, info (and bench, the load generator)."""

from __future__ import annotations

import asyncio
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
    client_tls_options,
    metadata,
    open_channel,
    parse_server,
    read_token,
    rpc_error,
)
from sloserve.cli.generate import generate
from sloserve.cli.http_options import http_limit_options, pop_http_limits
from sloserve.cli.options import (
    build_config,
    engine_options,
    grpc_options,
    pop_engine_options,
    pop_grpc_config,
    with_engine,
    with_flag,
)
from sloserve.config import ServerConfig
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


def _metrics_port(text: str) -> int | None:
    if text.lower() == "off":
        return None
    if not text.isdigit() or int(text) > 65535:
        raise CliError(f"--metrics-port must be a port in 0..65535 or 'off', got {text!r}")
    return int(text)


@cli.command(cls=OneLineCommand)
@engine_options
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all)."
)
@click.option(
    "--port", default=50051, show_default=True, type=int, help="gRPC port (0 picks a free one)."
)
@click.option(
    "--metrics-port", default="9464", show_default=True, help="Prometheus port, or 'off'."
)
@click.option(
    "--http-port",
    default="8000",
    show_default=True,
    help="OpenAI-compatible HTTP API port; 'auto' picks a free one; 'off' or 0 serves gRPC only.",
)
@click.option(
    "--chat-template",
    default=None,
    metavar="FILE",
    help="Jinja chat template for /v1/chat/completions [default: the checkpoint's tokenizer_config.json].",
)
@click.option(
    "--served-model-name", default=None, help="Model id of the HTTP API [default: --model]."
)
@click.option(
    "--auth-token",
    "--api-key",
    "auth_token",
    envvar="SLOSERVE_AUTH_TOKEN",
    default=None,
    help="Require 'authorization: Bearer TOKEN' on every call (--api-key: vLLM's name for it).",
)
@click.option("--auth-token-file", default=None, help="Read the bearer token from this file.")
@click.option("--tls-cert", default=None, help="PEM certificate chain (TLS on; needs --tls-key).")
@click.option("--tls-key", default=None, help="PEM private key of --tls-cert.")
@click.option(
    "--tls-ca",
    default=None,
    help="PEM CA certificates: clients must present a certificate signed by "
    "one of them (mTLS) on the gRPC, HTTP and metrics ports; needs --tls-cert.",
)
@click.option(
    "--metrics-host",
    default=None,
    help="Address the Prometheus port binds, e.g. 127.0.0.1 to keep it local [default: --host].",
)
@click.option(
    "--metrics-token",
    envvar="SLOSERVE_METRICS_TOKEN",
    default=None,
    help="Require 'authorization: Bearer TOKEN' on the Prometheus port [default: open].",
)
@click.option(
    "--max-tokens-limit",
    default=4096,
    show_default=True,
    type=int,
    help="Largest max_tokens accepted.",
)
@click.option(
    "--max-logprobs",
    default=20,
    show_default=True,
    type=int,
    help="Most top log-probabilities per token a request may ask for (logprobs, top_logprobs).",
)
@click.option(
    "--max-n",
    default=16,
    show_default=True,
    type=int,
    help="Most choices (n) one request may ask for.",
)
@click.option(
    "--max-prompts-per-request",
    default=64,
    show_default=True,
    type=int,
    help="Most prompts one /v1/completions request may batch (a list of prompts).",
)
@click.option(
    "--max-prompt-tokens",
    default=None,
    type=int,
    help="Longest prompt accepted [default: context length].",
)
@click.option(
    "--max-stop-strings",
    default=16,
    show_default=True,
    type=int,
    help="Most stop strings one request may give (0: none allowed).",
)
@click.option(
    "--max-stop-string-chars",
    default=256,
    show_default=True,
    type=int,
    help="Longest stop string accepted, in characters.",
)
@click.option(
    "--max-stop-token-ids",
    default=64,
    show_default=True,
    type=int,
    help="Most stop_token_ids one request may give (0: none allowed).",
)
@click.option(
    "--grace",
    default=10.0,
    show_default=True,
    type=float,
    help="Seconds in-flight requests get to finish on SIGTERM/SIGINT.",
)
@click.option(
    "--log-format", default="text", show_default=True, type=click.Choice(["text", "json"])
)
@click.option(
    "--engine-process/--no-engine-process",
    default=True,
    show_default=True,
    help="Run the engine in a process of its own (off: a thread of the server process).",
)
@click.option(
    "--idle-spin",
    default=1.0,
    show_default=True,
    type=float,
    metavar="SECONDS",
    help="The engine process keeps polling for input this long after its last step before it sleeps: "
    "a core kept awake serves the next prompt at full speed (0: sleep at once, to spare the CPU).",
)
@click.option(
    "--frontends",
    default=1,
    show_default=True,
    type=int,
    metavar="N",
    help="Front-end processes (gRPC + HTTP intake, tokenizing) sharing one engine process and the same "
    "ports (SO_REUSEPORT): more requests a second can be taken in and refused. Each serves its own "
    "metrics, front end k on --metrics-port + k.",
)
@http_limit_options
@click.option(
    "--metrics-compat",
    default="none",
    show_default=True,
    type=click.Choice(["none", "vllm"]),
    help="vllm: also export the vllm:-named series gateways (the Inference Extension's endpoint picker) "
    "and dashboards scrape.",
)
@grpc_options
def serve(make_core=None, **kwargs) -> None:
    """Serve a model over gRPC and an OpenAI-compatible HTTP API until SIGTERM/SIGINT (then drain, exit 0)."""
    # NOTE: `make_core` is no flag: python -m sloserve.testing.serve_faults passes a fault-injecting core
    engine_opts = pop_engine_options(kwargs)
    http_limits = pop_http_limits(kwargs)
    grpc_config = pop_grpc_config(kwargs)
    check_model(engine_opts["model"])
    token = read_token(kwargs["auth_token"], kwargs["auth_token_file"])
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        path = kwargs[flag]
        if path is not None and not Path(path).is_file():
            raise CliError(f"--{flag.replace('_', '-')} {path!r} is not a readable file")
    try:
        server = ServerConfig(
            host=kwargs["host"],
            port=kwargs["port"],
            metrics_port=_metrics_port(kwargs["metrics_port"]),
            auth_token=token,
            tls_cert=kwargs["tls_cert"],
            tls_key=kwargs["tls_key"],
            tls_ca=kwargs["tls_ca"],
            metrics_host=kwargs["metrics_host"],
            metrics_token=kwargs["metrics_token"],
            max_tokens_limit=kwargs["max_tokens_limit"],
            max_prompt_tokens=kwargs["max_prompt_tokens"],
            max_logprobs=kwargs["max_logprobs"],
            max_n=kwargs["max_n"],
            max_stop_strings=kwargs["max_stop_strings"],
            max_stop_string_chars=kwargs["max_stop_string_chars"],
            max_stop_token_ids=kwargs["max_stop_token_ids"],
            max_prompts_per_request=kwargs["max_prompts_per_request"],
            grace_s=kwargs["grace"],
            log_format=kwargs["log_format"],
            engine_process=kwargs["engine_process"],
            idle_spin_s=kwargs["idle_spin"],
            frontends=kwargs["frontends"],
            metrics_compat=kwargs["metrics_compat"],
            served_model_name=kwargs["served_model_name"],
        )
    except ValueError as exc:
        raise CliError(with_flag(str(exc))) from None
    if server.max_prompt_tokens is not None and server.max_prompt_tokens < 1:
        raise CliError("--max-prompt-tokens must be >= 1")
    if server.grace_s < 0:
        raise CliError("--grace must be >= 0 seconds")
    config = build_config(engine_opts, server, grpc=grpc_config)
    if config.parallel.node_rank > 0:
        sys.exit(_serve_node(config))
    http = _http_config(kwargs, http_limits)
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


def _http_config(kwargs: dict, limits: dict):
    """The HTTP edge's settings, or None for --http-port off."""
    from sloserve.http.config import HttpConfig

    port = _http_port(kwargs["http_port"])
    template = kwargs["chat_template"]
    if template is not None and not Path(template).is_file():
        raise CliError(f"--chat-template {template!r} is not a readable file")
    if port is None:
        return None
    try:
        return HttpConfig(
            port=port, chat_template=template, model_name=kwargs["served_model_name"], **limits
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


INFO_KEYS = (
    "model",
    "architecture",
    "version",
    "device",
    "attention_backend",
    "max_model_len",
    "max_prompt_tokens",
    "max_tokens_limit",
    "block_size",
    "expert_residency",
    "num_experts",
    "expert_slots_per_layer",
    "expert_device_bytes",
    "tensor_parallel_size",
    "tensor_parallel_devices",
)


@cli.command(cls=OneLineCommand)
@click.option(
    "--server",
    default=None,
    help="HOST:PORT of a running server [default: load --model in process].",
)
@engine_options
@click.option(
    "--auth-token",
    "--api-key",
    "auth_token",
    envvar="SLOSERVE_AUTH_TOKEN",
    default=None,
    help="Bearer token of the server (--api-key: the same).",
)
@client_tls_options
@click.option(
    "--timeout", default=10.0, show_default=True, type=float, help="Seconds to reach the server."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(server, auth_token, tls_ca, tls_cert, tls_key, timeout, as_json, **kwargs) -> None:
    """Server state (loading, serving, draining, engine_dead), model, limits and live engine statistics."""
    engine_opts = pop_engine_options(kwargs)
    if server is not None:
        data = asyncio.run(
            _remote_info(parse_server(server), auth_token, (tls_ca, tls_cert, tls_key), timeout)
        )
    else:
        check_model(engine_opts["model"])
        data = asyncio.run(with_engine(build_config(engine_opts), _local_info))
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
