"""mTLS on every port of a real `sloserve serve --tls-ca`: gRPC, HTTP and Prometheus refuse a client
without a certificate (or with one another CA signed) and serve one whose certificate the CA signed;
the Prometheus port also wants --metrics-token."""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.pki import Authority

from tests.http.conftest import HttpServerProcess, start

pytestmark = pytest.mark.timeout(180)

METRICS_TOKEN = "scrape-" + "5" * 20


class Pki:
    def __init__(self, folder: Path) -> None:
        self.ca = Authority.create(folder / "ca")
        self.server = self.ca.issue("server", server=True)
        self.client = self.ca.issue("client", server=False)
        self.impostor = Authority.create(folder / "other", "other-ca").issue(
            "impostor", server=False
        )

    def grpc_credentials(self, client: tuple[Path, Path] | None) -> grpc.ChannelCredentials:
        cert, key = client or (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.cert.read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None,
        )

    def ssl_context(self, client: tuple[Path, Path] | None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca.cert))
        if client is not None:
            context.load_cert_chain(*map(str, client))
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(tiny_llama: Path, pki: Pki) -> Iterator[HttpServerProcess]:
    cert, key = pki.server
    server = start(
        tiny_llama,
        None,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--tls-ca",
        str(pki.ca.cert),
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--metrics-token",
        METRICS_TOKEN,
        credentials=pki.grpc_credentials(pki.client),
    )
    try:
        yield server
    finally:
        server.stop()


def _metrics_url(server: HttpServerProcess) -> str:
    line = server.wait_log(lambda m: m.startswith("listening on "), 5)
    found = re.search(r"metrics on (https://127\.0\.0\.1:\d+/metrics)", line)
    assert found, line
    return found.group(1)


def _info(server: HttpServerProcess, credentials: grpc.ChannelCredentials) -> pb.InfoResponse:
    with server.sync_channel(credentials) as channel:
        return pb_grpc.SloserveStub(channel).Info(pb.InfoRequest(), timeout=10)


def test_grpc_needs_a_client_certificate_the_ca_signed(server, pki):
    assert "mTLS" in server.wait_log(lambda m: m.startswith("listening on "), 5)
    assert _info(server, pki.grpc_credentials(pki.client)).max_tokens_limit > 0
    for client in (None, pki.impostor):
        with pytest.raises(grpc.RpcError) as info:
            _info(server, pki.grpc_credentials(client))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def test_http_needs_a_client_certificate_the_ca_signed(server, pki):
    url = server.url.replace("http://", "https://")
    reply = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        verify=pki.ssl_context(pki.client),
        timeout=30,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    for client in (None, pki.impostor):
        with pytest.raises(httpx.HTTPError):  # the handshake fails (TLS 1.3: at the first read)
            httpx.get(f"{url}/health", verify=pki.ssl_context(client), timeout=10)


def test_the_metrics_port_wants_the_certificate_and_the_token(server, pki):
    url = _metrics_url(server)
    good = {"Authorization": f"bearer {METRICS_TOKEN}"}
    reply = httpx.get(url, headers=good, verify=pki.ssl_context(pki.client), timeout=10)
    assert reply.status_code == 200 and "sloserve_requests_total" in reply.text
    assert httpx.get(url, verify=pki.ssl_context(pki.client), timeout=10).status_code == 401
    for client in (None, pki.impostor):
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, headers=good, verify=pki.ssl_context(client), timeout=10)
    with pytest.raises(httpx.HTTPError):  # and no plaintext
        httpx.get(url.replace("https://", "http://"), headers=good, timeout=10)
    # the HTTP port's /metrics wants the same token
    http_metrics = server.url.replace("http://", "https://") + "/metrics"
    assert (
        httpx.get(http_metrics, verify=pki.ssl_context(pki.client), timeout=10).status_code == 401
    )
    assert (
        httpx.get(
            http_metrics, headers=good, verify=pki.ssl_context(pki.client), timeout=10
        ).status_code
        == 200
    )


def test_the_cli_clients_present_a_client_certificate(server, pki):
    cert, key = pki.client
    common = [
        "--server",
        f"127.0.0.1:{server.port}",
        "--tls-ca",
        str(pki.ca.cert),
        "--timeout",
        "5",
    ]
    info = CliRunner().invoke(
        cli, ["info", *common, "--tls-cert", str(cert), "--tls-key", str(key), "--json"]
    )
    assert info.exit_code == 0 and orjson.loads(info.stdout)["state"] == "serving", info.output
    generated = CliRunner().invoke(
        cli,
        [
            "generate",
            "hi",
            "--max-tokens",
            "2",
            *common,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--json",
        ],
    )
    assert generated.exit_code == 0 and orjson.loads(generated.stdout)["finish_reason"], (
        generated.output
    )
    # no client certificate: the handshake fails
    refused = CliRunner().invoke(cli, ["info", *common])
    assert refused.exit_code == 2 and "--tls-cert/--tls-key" in refused.output, refused.output
    half = CliRunner().invoke(cli, ["info", *common, "--tls-cert", str(cert)])
    assert half.exit_code == 2 and "needs both --tls-cert and --tls-key" in half.output, half.output
