"""LoRA over a real `sloserve serve` (engine process): `model` names an adapter, /v1/models lists
them, adapters load and unload while serving, behind the bearer token; bad input is refused."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from sloserve.testing.server_process import WITH_FAULTS

from tests.http.conftest import AUTH, SLOW, TOKEN, HttpServerProcess, start
from tests.lora.adapters import merged_greedy

PROMPT = (256, 72, 101, 108, 108, 111, 44, 32)
NEW = 6


@pytest.fixture(scope="module")
def lora_server(make_checkpoint, make_lora, adapter_root) -> Iterator[HttpServerProcess]:
    base = make_checkpoint("llama")
    first = make_lora("llama", rank=8, seed=1)
    make_lora("llama", rank=64, seed=2)  # loaded by a test through the API
    server = start(
        base,
        None,
        "--auth-token",
        TOKEN,
        "--lora-dir",
        str(adapter_root),
        "--lora-modules",
        f"first={first}",
        "--inject-faults",
        f"slow-step:{SLOW}=0.05",
        command=WITH_FAULTS,
    )
    try:
        yield server
    finally:
        server.stop()


def _complete(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": list(PROMPT), "max_tokens": NEW, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def _post(url: str, route: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_model_names_an_adapter_and_models_lists_it(lora_server, make_checkpoint, make_lora):
    url = lora_server.url
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    base_id = models[0]["id"]
    assert [(m["id"], m.get("parent")) for m in models[1:]] == [("first", base_id)]
    assert httpx.get(f"{url}/v1/models/first", headers=AUTH).json()["parent"] == base_id
    answer = _complete(url, "first")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "first"
    want = merged_greedy(
        make_checkpoint("llama"), make_lora("llama", rank=8, seed=1), (PROMPT,), NEW
    )[0]
    assert answer.json()["choices"][0]["token_ids"] == want
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "first", "prompt": "Hi"}, headers=AUTH)
    assert tokenized.status_code == 200 and tokenized.json()["tokens"][-2:] == [72, 105]
    base = _complete(url, base_id).json()["choices"][0]["token_ids"]
    assert base == merged_greedy(make_checkpoint("llama"), None, (PROMPT,), NEW)[0] != want


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_adapter_is_404_model_not_found(lora_server, stream):
    answer = _complete(lora_server.url, "nope", stream=stream)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "model_not_found"
    assert "'nope'" in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "model"


def test_load_generate_unload_while_serving(lora_server, make_checkpoint, make_lora):
    url = lora_server.url
    name = make_lora("llama", rank=64, seed=2).name  # relative to --lora-dir
    assert (
        _post(url, "load_lora_adapter", {"lora_name": "late", "lora_path": name}).status_code == 200
    )
    answer = _complete(url, "late")
    want = merged_greedy(
        make_checkpoint("llama"), make_lora("llama", rank=64, seed=2), (PROMPT,), NEW
    )[0]
    assert answer.json()["choices"][0]["token_ids"] == want
    again = _post(url, "load_lora_adapter", {"lora_name": "late", "lora_path": name})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert _post(url, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert _complete(url, "late").status_code == 404
    gone = _post(url, "unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
    assert "late" not in ids and "first" in ids


def test_bad_loads_are_refused_and_need_the_token(lora_server, make_lora, tmp_path):
    url = lora_server.url
    path = str(make_lora("llama", rank=8, seed=1))
    body = {"lora_name": "x", "lora_path": path}
    assert _post(url, "load_lora_adapter", body, headers={}).status_code == 401
    outside = _post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert outside.status_code == 400 and "outside --lora-dir" in outside.json()["error"]["message"]
    missing = _post(url, "load_lora_adapter", {"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert _post(url, "unload_lora_adapter", {"lora_name": "first"}, headers={}).status_code == 401


def test_grpc_adapter_field_generates_with_it_and_an_unknown_one_is_not_found(
    lora_server, make_checkpoint, make_lora
):
    import grpc
    from sloserve.pb import serving_pb2 as pb
    from sloserve.pb import serving_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {TOKEN}")]

    def generate(adapter: str) -> list[int]:
        request = pb.GenerateRequest(
            request_id="g1",
            token_ids=pb.TokenIds(ids=list(PROMPT)),
            max_tokens=NEW,
            sampling=pb.SamplingParams(ignore_eos=True),
            adapter=adapter,
        )
        with lora_server.sync_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            messages = list(stub.Generate(request, metadata=metadata, timeout=60))
        return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]

    want = merged_greedy(
        make_checkpoint("llama"), make_lora("llama", rank=8, seed=1), (PROMPT,), NEW
    )[0]
    assert generate("first") == want
    with pytest.raises(grpc.RpcError) as info:
        generate("nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in info.value.details()


def test_unloading_an_adapter_with_requests_in_flight_is_409(lora_server):
    """Refused while a (slowed) streaming request of it runs, which then finishes normally."""
    url = lora_server.url
    started, chunks = threading.Event(), []
    body = {"model": "first", "prompt": list(PROMPT), "max_tokens": 400, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}

    def stream() -> None:
        headers = {**AUTH, "x-request-id": SLOW}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60
        ) as r:
            for line in r.iter_lines():
                chunks.append(line)
                started.set()

    slow = threading.Thread(target=stream)
    slow.start()
    assert started.wait(30)
    busy = _post(url, "unload_lora_adapter", {"lora_name": "first"})
    slow.join()
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "adapter_in_use"
    assert chunks[-1] == "data: [DONE]" or chunks[-2] == "data: [DONE]"
    assert _post(url, "unload_lora_adapter", {"lora_name": "first"}).status_code == 200


def _grpc(lora_server, call: str, request, token: str | None = TOKEN):
    """One unary rpc on the server; its reply (an RpcError raises)."""
    from sloserve.pb import serving_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    with lora_server.sync_channel() as channel:
        return getattr(pb_grpc.SloserveStub(channel), call)(request, metadata=metadata, timeout=60)


def _grpc_code(lora_server, call: str, request, **kw):
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        _grpc(lora_server, call, request, **kw)
    return info.value.code(), info.value.details()


def test_grpc_loads_and_unloads_adapters_with_precise_statuses(
    lora_server, make_checkpoint, make_lora, adapter_root
):
    import grpc
    from sloserve.pb import serving_pb2 as pb

    path = make_lora("llama", rank=64, seed=2)
    load = pb.LoadAdapterRequest(name="g64", path=path.name)
    assert _grpc_code(lora_server, "LoadAdapter", load, token=None)[0] == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    assert "g64" in _grpc(lora_server, "LoadAdapter", load).adapters
    assert (
        _complete(lora_server.url, "g64").json()["choices"][0]["token_ids"]
        == merged_greedy(make_checkpoint("llama"), path, (PROMPT,), NEW)[0]
    )
    again = _grpc_code(lora_server, "LoadAdapter", load)
    assert again[0] == grpc.StatusCode.INVALID_ARGUMENT and "already loaded" in again[1]
    outside = pb.LoadAdapterRequest(name="x", path="/etc")
    assert _grpc_code(lora_server, "LoadAdapter", outside)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _grpc_code(lora_server, "LoadAdapter", pb.LoadAdapterRequest(name="x"))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    unload = pb.UnloadAdapterRequest(name="g64")
    assert "g64" not in _grpc(lora_server, "UnloadAdapter", unload).adapters
    gone = _grpc_code(lora_server, "UnloadAdapter", unload)
    assert gone[0] == grpc.StatusCode.NOT_FOUND and "'g64'" in gone[1]


def _slow_grpc_stream(lora_server, adapter: str) -> tuple[threading.Thread, threading.Event, list]:
    """A slowed gRPC Generate of `adapter` in a thread: (thread, first-chunk event, [messages or
    the RpcError that ended it])."""
    import grpc
    from sloserve.pb import serving_pb2 as pb
    from sloserve.pb import serving_pb2_grpc as pb_grpc

    started, got = threading.Event(), []
    request = pb.GenerateRequest(
        request_id=SLOW,
        token_ids=pb.TokenIds(ids=list(PROMPT)),
        max_tokens=400,
        sampling=pb.SamplingParams(ignore_eos=True),
        adapter=adapter,
    )

    def run() -> None:
        metadata = [("authorization", f"Bearer {TOKEN}")]
        with lora_server.sync_channel() as channel:
            try:
                for message in pb_grpc.SloserveStub(channel).Generate(
                    request, metadata=metadata, timeout=60
                ):
                    got.append(message)
                    started.set()
            except grpc.RpcError as exc:
                got.append(exc)
                started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, started, got


def test_unload_aborting_in_flight_ends_them_with_not_found(lora_server, make_lora):
    import grpc
    from sloserve.pb import serving_pb2 as pb

    name = make_lora("llama", rank=8, seed=1).name
    _grpc(lora_server, "LoadAdapter", pb.LoadAdapterRequest(name="cut", path=name))
    thread, started, got = _slow_grpc_stream(lora_server, "cut")
    assert started.wait(30)
    unload = pb.UnloadAdapterRequest(name="cut", in_flight=pb.IN_FLIGHT_ABORT)
    assert "cut" not in _grpc(lora_server, "UnloadAdapter", unload).adapters
    thread.join(60)
    error = got[-1]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND
    assert "'cut' was unloaded while this request ran" in error.details()
    assert any(not isinstance(m, grpc.RpcError) and m.HasField("chunk") for m in got)


def test_unload_draining_refuses_new_requests_and_unloads_after_the_last(lora_server, make_lora):
    from sloserve.pb import serving_pb2 as pb

    url = lora_server.url
    name = make_lora("llama", rank=8, seed=1).name
    assert _post(url, "load_lora_adapter", {"lora_name": "d", "lora_path": name}).status_code == 200
    thread, started, got = _slow_grpc_stream(lora_server, "d")
    assert started.wait(30)
    bad = _post(url, "unload_lora_adapter", {"lora_name": "d", "in_flight": "later"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "in_flight"
    assert (
        _post(url, "unload_lora_adapter", {"lora_name": "d", "in_flight": "drain"}).status_code
        == 200
    )
    refused = _complete(url, "d")
    assert refused.status_code == 404 and "being unloaded" in refused.text
    models = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
    assert "d" not in models
    thread.join(60)
    assert got[-1].HasField("final")  # the request in flight finished normally
    # unloaded once it finished: the name is free to load again
    reload = _post(url, "load_lora_adapter", {"lora_name": "d", "lora_path": name})
    assert reload.status_code == 200, reload.text
    _grpc(lora_server, "UnloadAdapter", pb.UnloadAdapterRequest(name="d"))


def test_metrics_count_loads_unloads_and_each_adapter_s_requests_and_tokens(lora_server, make_lora):
    from tests.metrics_text import sample

    url = lora_server.url

    def metrics() -> str:
        return httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text

    before = metrics()
    name = make_lora("llama", rank=8, seed=1).name
    assert _post(url, "load_lora_adapter", {"lora_name": "m", "lora_path": name}).status_code == 200
    for _ in range(2):
        assert _complete(url, "m").status_code == 200
    after = metrics()
    assert sample(after, "sloserve_lora_requests_total", adapter="m") == 2
    assert sample(after, "sloserve_lora_generated_tokens_total", adapter="m") == 2 * NEW
    loads = sample(after, "sloserve_lora_loads_total")
    assert loads == sample(before, "sloserve_lora_loads_total") + 1
    assert (
        sample(after, "sloserve_lora_adapters_loaded")
        == sample(before, "sloserve_lora_adapters_loaded") + 1
    )
    assert sample(after, "sloserve_lora_adapter_bytes") > sample(
        before, "sloserve_lora_adapter_bytes"
    )
    assert _post(url, "unload_lora_adapter", {"lora_name": "m"}).status_code == 200
    gone = metrics()
    assert 'adapter="m"' not in gone
    assert (
        sample(gone, "sloserve_lora_unloads_total")
        == sample(after, "sloserve_lora_unloads_total") + 1
    )
