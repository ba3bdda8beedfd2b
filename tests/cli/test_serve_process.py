"""`sloserve serve` as a real process on a tiny checkpoint: generate/info against it, SIGTERM under load."""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request

import grpc
import orjson
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from sloserve.cli.main import cli
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.live_server import Transcript, gen, read_until
from sloserve.testing.server_process import ServerProcess

pytestmark = pytest.mark.timeout(240)


def start_server(model: str, *extra: str) -> tuple[ServerProcess, int]:
    """Start `sloserve serve` on free ports; return (the server, its metrics port)."""
    server = ServerProcess(
        [
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "off",
            "--device",
            "cpu",
            "--log-format",
            "json",
            "--kv-pool-size",
            "16MiB",
            *extra,
        ],
        startup_s=120,
    )
    line = server.wait_log(lambda m: m.startswith("listening on "), 0)
    found = re.match(r"listening on 127\.0\.0\.1:\d+ .*metrics on http://127\.0\.0\.1:(\d+)/", line)
    assert found, line
    return server, int(found.group(1))


async def test_serve_generate_info_and_sigterm_under_load(tiny_llama):
    server, metrics_port = start_server(str(tiny_llama), "--grace", "60")
    address = server.target
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.to_thread(server.wait_ready, 120)
            # the CLI client commands against the live server
            result = await asyncio.to_thread(
                CliRunner().invoke,
                cli,
                ["generate", "0123", "--server", address, "--max-tokens", "5", "--json"],
            )
            assert result.exit_code == 0, result.output
            data = orjson.loads(result.stdout)
            assert len(data["token_ids"]) == 5 and data["finish_reason"] == "length"
            assert data["prompt_tokens"] >= 4 and data["e2e_s"] >= data["ttft_s"] > 0
            info = await asyncio.to_thread(
                CliRunner().invoke, cli, ["info", "--server", address, "--json"]
            )
            assert info.exit_code == 0, info.output
            stats = orjson.loads(info.stdout)
            assert stats["model"] == str(tiny_llama) and stats["architecture"] == "LlamaForCausalLM"
            assert (
                stats["kv_blocks_total"] > 0
                and stats["prompt_tokens_total"] == data["prompt_tokens"]
            )

            # SIGTERM while requests stream: they all finish, late ones are refused, exit 0
            call = pb_grpc.SloserveStub(channel).Stream()
            ids = [f"r{i}" for i in range(6)]
            for i, rid in enumerate(ids):
                await call.write(
                    gen(
                        rid,
                        text=f"{i}{i}{i}",
                        max_tokens=48,
                        sampling=pb.SamplingParams(ignore_eos=True),
                    )
                )
            transcript = Transcript()
            while not all(transcript.chunks(rid) for rid in ids):
                transcript.messages.append(await call.read())
            page = await asyncio.to_thread(
                lambda: (
                    urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
                    .read()
                    .decode()
                )
            )
            names = {f.name for f in text_string_to_metric_families(page)}
            assert {
                "sloserve_requests",
                "sloserve_kv_blocks_in_use",
                "sloserve_ttft_seconds",
            } <= names
            server.signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            await call.write(gen("late", max_tokens=2))
            await read_until(call, transcript, {*ids, "late"})
            for rid in ids:
                final = transcript.terminal(rid).final
                assert final.completion_tokens == 48 and len(transcript.tokens(rid)) == 48
            assert transcript.terminal("late").error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert await asyncio.to_thread(server.wait, 60) == 0
        messages = server.messages()
        assert "signal received: shutting down gracefully" in messages and "stopped" in messages
    finally:
        server.kill()


def test_in_process_generate_and_info(tiny_llama):
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "0123",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert len(data["token_ids"]) == 6 and data["finish_reason"] == "length"
    again = CliRunner().invoke(
        cli,
        [
            "generate",
            "0123",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ],
    )
    assert orjson.loads(again.stdout)["token_ids"] == data["token_ids"]  # greedy is deterministic
    text = CliRunner().invoke(
        cli,
        [
            "generate",
            "0123",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--max-tokens",
            "6",
            "--ignore-eos",
        ],
    )
    assert text.exit_code == 0 and text.stdout.rstrip("\n") == data["text"]
    info = CliRunner().invoke(
        cli, ["info", "--model", str(tiny_llama), "--device", "cpu", "--json"]
    )
    assert info.exit_code == 0, info.output
    stats = orjson.loads(info.stdout)
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
        assert key in stats, key
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] > 0
