"""`generate --server` and `info --server` against a live (fake-engine) server."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli

from tests.cli.conftest import TOKEN

pytestmark = pytest.mark.timeout(60)


def expected(text: str, n: int) -> list[int]:
    base = sum(text.encode())
    return [(base + i) % 200 + 32 for i in range(n)]


def test_generate_streams_text(fake_server):
    result = CliRunner().invoke(
        cli, ["generate", "abc", "--server", fake_server.address, "--max-tokens", "6"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "".join(map(chr, expected("abc", 6))) + "\n"
    assert "[length; 6 tokens; prompt 3 tokens;" in result.stderr


def test_generate_json(fake_server):
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "hello",
            "--server",
            fake_server.address,
            "--max-tokens",
            "4",
            "--temperature",
            "0.5",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--seed",
            "7",
            "--stop",
            "zz",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert data["token_ids"] == expected("hello", 4)
    assert data["text"] == "".join(map(chr, expected("hello", 4)))
    assert data["finish_reason"] == "length" and data["prompt_tokens"] == 5
    assert 0 < data["ttft_s"] <= data["e2e_s"]


def test_generate_server_side_rejection_is_one_line(fake_server):
    result = CliRunner().invoke(cli, ["generate", "x" * 300, "--server", fake_server.address])
    assert result.exit_code == 2
    assert (
        result.stderr.strip().startswith("Error: 127.0.0.1:")
        and "INVALID_ARGUMENT" in result.stderr
    )
    assert "context length" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_info_json_has_the_documented_keys(fake_server):
    result = CliRunner().invoke(cli, ["info", "--server", fake_server.address, "--json"])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    for key in (
        "model",
        "kv_blocks_total",
        "kv_blocks_free",
        "kv_blocks_cached",
        "waiting",
        "running",
        "prompt_tokens_total",
        "prefix_hit_tokens_total",
    ):
        assert key in data, key
    assert data["kv_blocks_total"] == 64 and isinstance(data["prompt_tokens_total"], int)
    assert data["architecture"] == "FakeForCausalLM" and data["state"] == "serving"


def test_info_text(fake_server):
    result = CliRunner().invoke(cli, ["info", "--server", fake_server.address])
    assert result.exit_code == 0, result.output
    assert any(line.split() == ["kv_blocks_total", "64"] for line in result.stdout.splitlines())
    assert result.stdout.splitlines()[0].split() == ["state", "serving"]


def test_auth_token_is_sent_and_required(auth_server):
    denied = CliRunner().invoke(cli, ["info", "--server", auth_server.address])
    assert (
        denied.exit_code == 2
        and "UNAUTHENTICATED" in denied.stderr
        and "--auth-token" in denied.stderr
    )
    ok = CliRunner().invoke(
        cli, ["info", "--server", auth_server.address, "--auth-token", TOKEN, "--json"]
    )
    assert ok.exit_code == 0, ok.output
    gen = CliRunner().invoke(
        cli,
        [
            "generate",
            "hi",
            "--server",
            auth_server.address,
            "--auth-token",
            TOKEN,
            "--max-tokens",
            "2",
            "--json",
        ],
    )
    assert gen.exit_code == 0 and orjson.loads(gen.stdout)["token_ids"] == expected("hi", 2)
