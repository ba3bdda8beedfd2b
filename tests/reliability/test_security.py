"""Security of a real `sloserve serve`: loopback by default, bearer token, TLS, size and length limits.

One server with TLS (a self-signed certificate made here), a token (passed through the
environment, never argv), --max-prompt-tokens 100 and --max-tokens-limit 50, started without
--host so the default bind is what is checked.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.pki import self_signed
from sloserve.testing.server_process import SERVICE_NAME, ServerProcess

pytestmark = pytest.mark.timeout(300)

TOKEN = "reliability-" + "7" * 24
GOOD = (("authorization", f"Bearer {TOKEN}"),)
MAX_PROMPT, MAX_TOKENS = 100, 50
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def creds(tls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls[0].read_bytes())


@pytest.fixture(scope="module")
def server(tiny_llama, tls, creds):
    cert, key = tls
    server = ServerProcess.cli(
        tiny_llama,
        "--max-model-len",
        "256",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--max-prompt-tokens",
        str(MAX_PROMPT),
        "--max-tokens-limit",
        str(MAX_TOKENS),
        env={"SLOSERVE_AUTH_TOKEN": TOKEN},
    )
    try:
        server.wait_ready(credentials=creds, metadata=GOOD)
        yield server
    finally:
        server.stop()


@pytest.fixture
def stub(server, creds):
    with server.sync_channel(creds) as channel:
        yield pb_grpc.SloserveStub(channel)


def _listeners(port: int) -> list[tuple[str, str]]:
    """(table, local address hex) of every listening socket on `port`, from /proc/net/tcp{,6}."""
    found = []
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A = LISTEN
                found.append((table, address))
    return found


def test_default_bind_is_loopback_only(server):
    assert server.host == "127.0.0.1"
    listeners = _listeners(server.port)
    assert listeners, "no listening socket found for the port"
    loopback = {
        ("tcp", "0100007F"),
        ("tcp6", "0000000000000000FFFF00000100007F"),  # 127.0.0.1, ::ffff:127.0.0.1
        ("tcp6", "00000000000000000000000001000000"),
    }  # ::1
    assert set(listeners) <= loopback, f"listening beyond loopback: {listeners}"
    assert TOKEN not in " ".join(server.argv), (
        "the token must not be visible in the process arguments"
    )


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        (("authorization", "Bearer wrong"),),
        (("authorization", TOKEN),),
        (("authorization", f"bearer {TOKEN}x"),),
    ],
    ids=["missing", "wrong", "no-scheme", "suffix"],
)
def test_calls_without_the_right_token_are_unauthenticated(server, creds, stub, metadata):
    calls = {
        "Info": lambda: stub.Info(pb.InfoRequest(), metadata=metadata, timeout=10),
        "Generate": lambda: list(
            stub.Generate(
                pb.GenerateRequest(request_id="g", text="hi", max_tokens=2),
                metadata=metadata,
                timeout=10,
            )
        ),
        "Stream": lambda: list(
            stub.Stream(
                iter(
                    [
                        pb.ClientMessage(
                            generate=pb.GenerateRequest(request_id="s", text="hi", max_tokens=2)
                        )
                    ]
                ),
                metadata=metadata,
                timeout=10,
            )
        ),
    }
    with server.sync_channel(creds) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        calls["Reflection"] = lambda: list(
            reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=metadata,
                timeout=10,
            )
        )
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == UNAUTHENTICATED, (name, info.value)
            assert "bearer token" in info.value.details(), (name, info.value.details())
        # Health is exempt, so Kubernetes gRPC probes (which send no metadata) work.
        for service in ("", SERVICE_NAME):
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_the_right_token_over_tls_works(stub):
    info = stub.Info(pb.InfoRequest(), metadata=GOOD, timeout=10)
    assert (info.max_prompt_tokens, info.max_tokens_limit) == (MAX_PROMPT, MAX_TOKENS)
    replies = list(
        stub.Generate(
            pb.GenerateRequest(request_id="ok", text="hello", max_tokens=3),
            metadata=GOOD,
            timeout=30,
        )
    )
    assert replies[-1].WhichOneof("kind") == "final", replies[-1]


def test_plaintext_and_untrusted_clients_cannot_connect(server, tmp_path):
    other_cert, _ = self_signed(tmp_path, "impostor")  # a client trusting another certificate
    for credentials in (
        None,
        grpc.ssl_channel_credentials(root_certificates=other_cert.read_bytes()),
    ):
        with server.sync_channel(credentials) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.SloserveStub(channel).Info(pb.InfoRequest(), metadata=GOOD, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def _gen(stub, **kw) -> pb.ServerMessage:
    replies = list(
        stub.Stream(
            iter([pb.ClientMessage(generate=pb.GenerateRequest(request_id="r", **kw))]),
            metadata=GOOD,
            timeout=60,
        )
    )
    return replies[-1]


def test_prompt_and_max_token_limits_are_enforced(stub):
    # The byte-level tokenizer gives one token per byte plus <s>: 99 bytes = 100 tokens.
    assert _gen(stub, text="a" * (MAX_PROMPT - 1), max_tokens=1).WhichOneof("kind") == "final"
    too_long = _gen(stub, text="a" * MAX_PROMPT, max_tokens=1).error
    assert (
        too_long.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        and f"limit of {MAX_PROMPT}" in too_long.message
    )
    ids = _gen(stub, token_ids=pb.TokenIds(ids=[97] * (MAX_PROMPT + 1)), max_tokens=1).error
    assert ids.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], ids
    assert _gen(stub, text="hi", max_tokens=MAX_TOKENS).final.completion_tokens <= MAX_TOKENS
    over = _gen(stub, text="hi", max_tokens=MAX_TOKENS + 1).error
    assert (
        over.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        and f"limit of {MAX_TOKENS}" in over.message
    )


def test_oversized_messages_are_refused_by_the_size_limit(server, stub):
    huge = "x" * (17 * 2**20)  # over the default 16 MiB max message size
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Generate(
                pb.GenerateRequest(request_id="big", text=huge), metadata=GOOD, timeout=60
            )
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Stream(
                iter([pb.ClientMessage(generate=pb.GenerateRequest(request_id="big", text=huge))]),
                metadata=GOOD,
                timeout=60,
            )
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert stub.Info(pb.InfoRequest(), metadata=GOOD, timeout=10).stats.running == 0


def test_a_large_prompt_under_the_size_limit_does_not_stall_other_clients(server, stub):
    """A 1 MB prompt is refused (prompt limit) while another client's calls keep being answered."""
    worst = [0.0]
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                stub.Info(pb.InfoRequest(), metadata=GOOD, timeout=60)
            except grpc.RpcError:
                worst[0] = float("inf")
            worst[0] = max(worst[0], time.monotonic() - start)
            time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        error = _gen(stub, text="y" * 10**6, max_tokens=1).error
        refused_after = time.monotonic() - started
    finally:
        stop.set()
        thread.join(60)
    print(
        f"\n1 MB prompt refused after {refused_after:.2f}s; slowest concurrent Info {worst[0] * 1e3:.0f} ms"
    )
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], error
    assert worst[0] < 1.0, f"another client waited {worst[0]:.2f}s while one prompt was checked"
