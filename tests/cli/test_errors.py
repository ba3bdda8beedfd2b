"""Every user error is one line saying what to change, exit status 2, no traceback."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli
from sloserve.testing.serve_faults import cli as cli_with_faults


def free_port_in_use() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def engine_available() -> bool:
    try:
        from sloserve.engine import AsyncEngine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def not_a_checkpoint(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


CASES = [
    (["serve", "--model", "/no/such/folder"], "model folder '/no/such/folder' does not exist"),
    (
        ["generate", "hi", "--model", "/no/such/folder"],
        "model folder '/no/such/folder' does not exist",
    ),
    (["info", "--model", "/no/such/folder"], "model folder '/no/such/folder' does not exist"),
    (["serve", "--model", "{file}"], "is a file: give the checkpoint folder"),
    (
        ["serve", "--model", "{ckpt}"],
        "is not a Hugging Face checkpoint folder: missing *.safetensors",
    ),
    (
        [
            "serve",
            "--model",
            "{broken}",
            "--port",
            "0",
            "--metrics-port",
            "off",
            "--http-port",
            "off",
        ],
        "cannot load model '{broken}': ",
    ),
    (["serve", "--kv-pool-size", "lots"], "--kv-pool-size: cannot read size 'lots'"),
    (["serve", "--kv-pool-size", "0"], "--kv-pool-size: size must be > 0"),
    (["serve", "--max-batch", "0"], "--max-batch: max batch must be >= 1"),
    (["serve", "--max-batch", "x"], "Invalid value for '--max-batch'"),
    (["serve", "--max-wait", "0"], "--max-wait: max wait must be > 0 seconds"),
    (["serve", "--block-size", "12"], "--block-size: block_size must be a power of two"),
    (["serve", "--policy", "lifo"], "Invalid value for '--policy'"),
    (["serve", "--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
    (["serve", "--port", "70000"], "--port: port must be in 0..65535"),
    (["serve", "--metrics-port", "nine"], "--metrics-port must be a port in 0..65535 or 'off'"),
    (["serve", "--tls-cert", "{file}"], "TLS needs both --tls-cert and --tls-key"),
    (
        ["serve", "--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"],
        "--tls-cert '/no/cert.pem' is not a readable file",
    ),
    (
        ["serve", "--auth-token", "a", "--auth-token-file", "{file}"],
        "give either --auth-token or --auth-token-file",
    ),
    (["serve", "--auth-token-file", "/no/token"], "cannot read --auth-token-file '/no/token'"),
    (["serve", "--auth-token-file", "{empty}"], "is empty: put the token on its first line"),
    (["serve", "--max-tokens-limit", "0"], "--max-tokens-limit: max tokens limit must be >= 1"),
    (["serve", "--max-logprobs", "-1"], "--max-logprobs: max logprobs must be >= 0, got -1"),
    (["serve", "--max-n", "0"], "--max-n: max n must be >= 1, got 0"),
    (
        ["serve", "--max-prompts-per-request", "0"],
        "--max-prompts-per-request: max prompts per request must be >= 1, got 0",
    ),
    (["serve", "--grace", "-1"], "--grace must be >= 0 seconds"),
    (
        ["serve", "--max-stop-strings", "-1"],
        "--max-stop-strings: max stop strings must be >= 0, got -1",
    ),
    (
        ["serve", "--max-stop-string-chars", "0"],
        "--max-stop-string-chars: max stop string chars must be >= 1, got 0",
    ),
    (["serve", "--idle-spin", "-1"], "--idle-spin: idle spin must be in 0..60 seconds, got -1.0"),
    (
        ["serve", "--max-stop-token-ids", "-1"],
        "--max-stop-token-ids: max stop token ids must be >= 0, got -1",
    ),
    (["serve", "--frontends", "0"], "--frontends: frontends must be in 1..64, got 0"),
    (
        ["serve", "--frontends", "2", "--no-engine-process"],
        "--frontends: frontends > 1 needs the engine in a process",
    ),
    (["serve", "--grpc-max-streams", "0"], "--grpc-max-streams must be in 1..2147483647, got 0"),
    (
        ["serve", "--grpc-stream-stall-timeout", "0"],
        "--grpc-stream-stall-timeout must be > 0 seconds",
    ),
    (
        ["serve", "--grpc-max-connection-age", "-1"],
        "--grpc-max-connection-age must be >= 0 seconds (0: off)",
    ),
    (["serve", "--metrics-compat", "prom"], "Invalid value for '--metrics-compat'"),
    (
        ["serve", "--inject-faults", "explode:x"],
        "--inject-faults: fault rule 'explode:x': use KIND:MARKER",
    ),
    (["serve", "--port", "{busy}", "--metrics-port", "off"], "cannot listen on 127.0.0.1:"),
    (["generate"], "Missing argument 'PROMPT'"),
    (["generate", ""], "PROMPT is empty"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "hi", "--top-k", "-2"], "--top-k must be >= 0"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
    (["generate", "hi", "--stop", ""], "--stop strings must be non-empty"),
    (["generate", "hi", "--server", "localhost"], "--server must be HOST:PORT"),
    (["generate", "hi", "--server", "127.0.0.1:1", "--model", "/x"], "give either --server"),
    (
        ["generate", "hi", "--server", "127.0.0.1:{closed}", "--timeout", "0.5"],
        "cannot reach a sloserve server at 127.0.0.1:",
    ),
    (
        ["info", "--server", "127.0.0.1:{closed}", "--timeout", "0.5"],
        "cannot reach a sloserve server at 127.0.0.1:",
    ),
    (["info", "--server", "host:99999"], "--server must be HOST:PORT with a port in 1..65535"),
    (
        ["info", "--server", "127.0.0.1:1", "--tls-ca", "/no/ca.pem"],
        "cannot read --tls-ca '/no/ca.pem'",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "needle"), CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_user_error_is_one_line_exit_2(args, needle, tmp_path, not_a_checkpoint):
    if ("{busy}" in args or "{broken}" in args) and not engine_available():
        pytest.skip(
            "serve builds the engine before binding; sloserve.engine.AsyncEngine is missing"
        )
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    busy = free_port_in_use()
    closed = free_port_in_use()
    closed_port = closed.getsockname()[1]
    closed.close()
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    fill = {
        "file": str(a_file),
        "ckpt": not_a_checkpoint,
        "empty": str(empty),
        "broken": str(broken),
        "busy": str(busy.getsockname()[1]),
        "closed": str(closed_port),
    }
    # NOTE: the product has no fault switch: --inject-faults is the test entry point's
    entry = cli_with_faults if "--inject-faults" in args else cli
    try:
        result = CliRunner().invoke(entry, [a.format(**fill) for a in args])
    finally:
        busy.close()
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1 and needle.format(**fill) in errors[0], lines
    assert "Traceback" not in result.output
    assert not lines[-1].startswith("Usage:") and lines[-1].startswith("Error: ")
