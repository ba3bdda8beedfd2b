"""Pieces the CLI commands share: one-line errors (exit 2), server addresses, client channels."""

from __future__ import annotations

from pathlib import Path

import click
import grpc
from click.exceptions import NoArgsIsHelpError
from sloserve.bench.client import ready_within

DEFAULT_SERVER = "127.0.0.1:50051"
RANDOM_MODELS = ("default-random", "default-moe")
RANDOM_WEIGHTS_NOTE = (
    "note: the built-in '{model}' model has random weights, so its text is gibberish; it exercises "
    "the server, not the answers. --model default is trained on ARC grids; serve any other Hugging Face "
    "folder (config.json, *.safetensors, tokenizer.json) with --model /path/to/folder."
)


class CliError(click.ClickException):
    """A user error: one line on stderr saying what to change, exit status 2, no traceback."""

    exit_code = 2


class OneLineCommand(click.Command):
    """A click command whose usage errors (bad flag values, missing arguments) print as one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            if isinstance(exc, NoArgsIsHelpError):
                raise
            raise CliError(f"{exc.format_message()} (see sloserve {info_name} --help)") from None


def parse_server(text: str) -> str:
    """Validate HOST:PORT; CliError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(
            f"--server must be HOST:PORT with a port in 1..65535, e.g. {DEFAULT_SERVER}; got {text!r}"
        )
    return text


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The bearer token from --auth-token or --auth-token-file (one line; surrounding blank space ignored).

    A file with more than one non-empty line is refused, not cut to its first: a token with a
    line break in it could never match a header, and a wrong file (a key, a list) should not
    quietly become the token.
    """
    if token and token_file:
        raise CliError("give either --auth-token or --auth-token-file, not both")
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(
                f"cannot read --auth-token-file {token_file!r}: {getattr(exc, 'strerror', exc)}"
            ) from None
        if not token:
            raise CliError(
                f"--auth-token-file {token_file!r} is empty: put the token on its first line"
            )
        lines = [line for line in token.splitlines() if line.strip()]
        if len(lines) > 1:
            raise CliError(
                f"--auth-token-file {token_file!r} has {len(lines)} non-empty lines: a token is one "
                "line; leave only the token in the file"
            )
        token = token.strip()
    if token is not None and not token.strip():
        raise CliError("--auth-token must not be empty")
    return token


def check_model(model: str) -> None:
    """Fail fast, with a clear line, when --model is neither built in nor a checkpoint folder."""
    if model in ("default", *RANDOM_MODELS):
        return
    path = Path(model)
    if not path.exists():
        raise CliError(
            f"model folder {model!r} does not exist: give a Hugging Face checkpoint folder "
            "or --model default"
        )
    if not path.is_dir():
        raise CliError(
            f"--model {model!r} is a file: give the checkpoint folder that holds config.json"
        )
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise CliError(
            f"{model!r} is not a Hugging Face checkpoint folder: missing {', '.join(missing)}"
        )


def metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def client_tls_options(fn):
    """--tls-ca, and the client certificate --tls-cert/--tls-key for a server that wants one (its --tls-ca)."""
    for option in reversed(
        [
            click.option("--tls-ca", default=None, help="PEM root certificate of a TLS server."),
            click.option(
                "--tls-cert",
                default=None,
                help="PEM client certificate, for a server with --tls-ca (mTLS).",
            ),
            click.option("--tls-key", default=None, help="PEM private key of --tls-cert."),
        ]
    ):
        fn = option(fn)
    return fn


remote_or_local_option = click.option(
    "--server",
    default=None,
    help="HOST:PORT of a running server [default: load --model in process].",
)
auth_token_option = click.option(
    "--auth-token",
    "--api-key",
    "auth_token",
    envvar="SLOSERVE_AUTH_TOKEN",
    default=None,
    help="Bearer token of the server (--api-key: the same).",
)
timeout_option = click.option(
    "--timeout", default=10.0, show_default=True, type=float, help="Seconds to reach the server."
)


def client_options(fn):
    """How a client command reaches a server: --auth-token (--api-key), the client_tls_options, --timeout."""
    return auth_token_option(client_tls_options(timeout_option(fn)))


async def open_channel(
    server: str,
    tls_ca: str | None,
    timeout_s: float,
    cert: str | None = None,
    key: str | None = None,
) -> grpc.aio.Channel:
    """A connected channel (TLS when --tls-ca is given, with a client certificate when --tls-cert is);
    CliError when the server cannot be reached."""
    if (cert is None) != (key is None):
        raise CliError("a client certificate needs both --tls-cert and --tls-key")
    if cert is not None and not tls_ca:
        raise CliError("--tls-cert needs --tls-ca (the server's root certificate)")
    if tls_ca:
        pems = {}
        for flag, path in (("--tls-ca", tls_ca), ("--tls-cert", cert), ("--tls-key", key)):
            try:
                pems[flag] = Path(path).read_bytes() if path else None
            except OSError as exc:
                raise CliError(f"cannot read {flag} {path!r}: {exc.strerror}") from None
        creds = grpc.ssl_channel_credentials(
            root_certificates=pems["--tls-ca"],
            private_key=pems["--tls-key"],
            certificate_chain=pems["--tls-cert"],
        )
        channel = grpc.aio.secure_channel(server, creds)
    else:
        channel = grpc.aio.insecure_channel(server)
    if not await ready_within(channel, timeout_s):
        raise CliError(
            f"cannot reach a sloserve server at {server} within {timeout_s:g} s: start one with "
            "`sloserve serve`, or fix --server (and --tls-ca if it uses TLS, --tls-cert/--tls-key "
            "if it wants a client certificate)"
        )
    return channel


def rpc_error(exc: grpc.aio.AioRpcError, server: str) -> click.ClickException:
    """A one-line CLI error from a failed call (exit 2 for errors the user can fix, else 1)."""
    code = exc.code()
    message = f"{server}: {code.name}: {exc.details()}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        message += " (pass the server's token with --auth-token)"
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
    ):
        return CliError(message)
    return click.ClickException(message)
