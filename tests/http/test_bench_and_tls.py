"""`sloserve bench --url` drives the HTTP API with the same statistics; HTTP shares the server's TLS."""

from __future__ import annotations

import ssl

import grpc
import httpx
import orjson
import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli
from sloserve.testing.pki import self_signed

from tests.http.conftest import TOKEN, start

pytestmark = pytest.mark.timeout(120)


def test_bench_over_http_reports_the_same_statistics(http_server, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--url",
            http_server.url,
            "--workload",
            "fixed:32,6",
            "--num-requests",
            "8",
            "--concurrency",
            "4",
            "--ignore-eos",
            "--slo-ttft",
            "60",
            "--auth-token",
            TOKEN,
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    run = orjson.loads(out.read_bytes())["runs"][0]
    assert run["completed"] == 8 and run["failed"] == 0 and run["refused"] == 0
    assert run["output_tokens"] == 6 * 8 and run["prompt_tokens"] > 0
    assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"] and run["tpot_s"]["p50"] > 0
    assert run["slo_attainment"] == 1.0


def test_bench_url_must_be_http():
    result = CliRunner().invoke(cli, ["bench", "--url", "127.0.0.1:8000"])
    assert result.exit_code == 2 and "--url must start with http://" in result.output


def test_https_with_the_servers_certificate(tiny_llama, tmp_path):
    cert, key = self_signed(tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    server = start(
        tiny_llama, None, "--tls-cert", str(cert), "--tls-key", str(key), credentials=credentials
    )
    try:
        assert server.url.startswith("http://")
        url = server.url.replace("http://", "https://")
        context = ssl.create_default_context(cafile=str(cert))
        reply = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, verify=context
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        with pytest.raises(httpx.HTTPError):  # plaintext is not served on the TLS port
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        server.stop()
