"""`sloserve generate PROMPT`: stream one completion from a server or an in-process engine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import click
import grpc
import orjson
from sloserve import structured
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
    remote_or_local_option,
    rpc_error,
)
from sloserve.cli.options import build_config, engine_options, with_engine
from sloserve.errors import InvalidRequestError, RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

_FINISH = {1: "stop", 2: "length", 3: "cancelled"}


@dataclass
class Completion:
    """What --json prints."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None

    def add(self, ids, text: str, echo: bool) -> None:
        self.token_ids.extend(int(i) for i in ids)
        self.text += text
        if echo and text:
            click.echo(text, nl=False)


@click.command(cls=OneLineCommand)
@click.argument("prompt")
@remote_or_local_option
@engine_options
@click.option(
    "--max-tokens", default=64, show_default=True, type=int, help="Most tokens to generate."
)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option(
    "--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass in (0, 1]."
)
@click.option(
    "--top-k",
    default=0,
    show_default=True,
    type=int,
    help="Keep the k most likely tokens (0: off).",
)
@click.option("--seed", default=None, type=int, help="Seed of this request's sampler.")
@click.option("--stop", multiple=True, help="Stop when the text contains this string (repeatable).")
@click.option(
    "--ignore-eos", is_flag=True, help="Keep going past end-of-sequence until --max-tokens."
)
@click.option(
    "--arc-grid-grammar",
    is_flag=True,
    help="Constrain the answer to one ARC grid: rows of digits of one width, each ending in a newline, "
    "then EOS (give --max-tokens 931 for room for a 30x30 grid).",
)
@client_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of the text."
)
def generate(
    prompt,
    server,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop,
    ignore_eos,
    arc_grid_grammar,
    auth_token,
    tls_ca,
    tls_cert,
    tls_key,
    timeout,
    as_json,
    **kwargs,
) -> None:
    """Generate a completion of PROMPT, printing text as it streams."""
    if not prompt:
        raise CliError("PROMPT is empty: give the text to complete")
    if server is not None and kwargs["model"] != "default":
        raise CliError(
            "give either --server (use a running server) or --model (load in process), not both"
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=list(stop),
            ignore_eos=ignore_eos,
            grammar=structured.arc_grid_grammar() if arc_grid_grammar else None,
        )
    except InvalidRequestError as exc:
        raise CliError(_flagged(str(exc))) from None
    if server is not None:
        result = asyncio.run(
            _remote(
                parse_server(server),
                prompt,
                params,
                auth_token,
                (tls_ca, tls_cert, tls_key),
                timeout,
                not as_json,
            )
        )
    else:
        check_model(kwargs["model"])
        config = build_config(kwargs)
        if not as_json and config.model.path in RANDOM_MODELS:
            click.echo(RANDOM_WEIGHTS_NOTE.format(model=config.model.path), err=True)
        result = asyncio.run(
            with_engine(config, lambda engine: _local(engine, prompt, params, not as_json))
        )
    if as_json:
        click.echo(orjson.dumps(result.__dict__).decode())
    else:
        click.echo("")
        click.echo(
            f"[{result.finish_reason}; {len(result.token_ids)} tokens; prompt {result.prompt_tokens} "
            f"tokens; ttft {_fmt(result.ttft_s)}; total {_fmt(result.e2e_s)}]",
            err=True,
        )


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s"


def _flagged(message: str) -> str:
    """Name the CLI flag instead of the field: 'top_p must be ...' -> '--top-p must be ...'."""
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop"):
        if message.startswith(name):
            return "--" + name.replace("_", "-") + message[len(name) :]
    return message


async def _remote(
    server: str,
    prompt: str,
    params: SamplingParams,
    token: str | None,
    tls: tuple[str | None, str | None, str | None],
    timeout: float,
    echo: bool,
) -> Completion:
    from sloserve.pb import serving_pb2 as pb
    from sloserve.pb import serving_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(request_id="cli", text=prompt, max_tokens=params.max_tokens)
    s = request.sampling
    s.temperature, s.top_p, s.top_k, s.ignore_eos = (
        params.temperature,
        params.top_p,
        params.top_k,
        params.ignore_eos,
    )
    if params.seed is not None:
        s.seed = params.seed
    s.stop.extend(params.stop)
    if params.grammar is not None:
        s.structured.grammar = structured.arc_grid_lark()  # the only grammar this command sends
    result = Completion()
    tls_ca, cert, key = tls
    channel = await open_channel(server, tls_ca, timeout, cert, key)
    try:
        async for msg in pb_grpc.SloserveStub(channel).Generate(request, metadata=metadata(token)):
            if msg.WhichOneof("kind") == "chunk":
                result.add(msg.chunk.token_ids, msg.chunk.text, echo)
            elif msg.WhichOneof("kind") == "final":
                f = msg.final
                result.finish_reason = _FINISH.get(f.finish_reason, "unspecified")
                result.prompt_tokens, result.cached_prompt_tokens = (
                    f.prompt_tokens,
                    f.cached_prompt_tokens,
                )
                result.ttft_s, result.e2e_s = f.ttft_s, f.e2e_s
            else:
                raise CliError(f"{server}: {msg.error.reason}: {msg.error.message}")
    except grpc.aio.AioRpcError as exc:
        raise rpc_error(exc, server) from None
    finally:
        await channel.close()
    return result


async def _local(engine, prompt: str, params: SamplingParams, echo: bool) -> Completion:
    result = Completion()
    start = time.monotonic()
    try:
        token_ids = await asyncio.to_thread(engine.tokenizer.encode, prompt)
        async for out in engine.generate(NewRequest("cli", token_ids, params)):
            result.add(out.new_token_ids, out.new_text, echo)
            if result.ttft_s is None and out.new_token_ids:
                result.ttft_s = time.monotonic() - start
            if out.finished:
                if out.finish_reason == "error":
                    raise click.ClickException(f"generation failed: {out.error}")
                result.finish_reason = out.finish_reason
                result.prompt_tokens = out.num_prompt_tokens
                result.cached_prompt_tokens = out.num_cached_tokens
    except InvalidRequestError as exc:
        raise CliError(str(exc)) from None
    except RequestRefusedError as exc:
        raise CliError(f"refused ({exc.reason}): {exc}") from None
    result.e2e_s = time.monotonic() - start
    return result
