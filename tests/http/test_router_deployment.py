"""Two `sloserve serve` replicas behind SGLang Model Gateway (`smg launch`, PyPI sglang-router), all on
loopback: the router registers both under the served model name, round_robin spreads completions evenly,
and greedy tokens through the router equal a replica's own."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sloserve.testing.ports import free_port

from tests.http.conftest import HttpServerProcess, start

pytest.importorskip(
    "sglang_router",
    reason="SGLang Model Gateway is not installed: pip install sglang-router==0.3.2",
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
MODEL = "tiny"  # --served-model-name: the id the router must learn from /server_info
PROMPTS = [
    f"Input:\n{a}{b}\n{b}{a}\nOutput:\n"
    for a, b in ("12", "34", "56", "78", "90", "13", "57", "24")
]
BODY = {"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True}


class Router:
    """`python -m sglang_router launch ...` (the `smg launch` console script) with its log in a file."""

    def __init__(self, workers: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [
            sys.executable,
            "-m",
            "sglang_router",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *workers,
            "--policy",
            "round_robin",
            "--log-level",
            "info",
            # NOTE: its Prometheus exporter binds 0.0.0.0:29000 unless told, and panics if that is taken
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_workers(self, count: int, timeout: float = 30.0) -> list[dict]:
        """The router's /workers once `count` healthy workers are registered under a known model."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                workers = httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
                if len(workers) == count and all(
                    w["is_healthy"] and w["model_id"] != "unknown" for w in workers
                ):
                    return workers
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router never registered {count} workers:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def requests_served(replica: HttpServerProcess) -> float:
    """sloserve_requests_total summed over outcomes, from the replica's own /metrics."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "sloserve_requests"
        for sample in family.samples
        if sample.name == "sloserve_requests_total"
    )


@pytest.fixture(scope="module")
def replicas(tiny_llama: Path) -> Iterator[list[HttpServerProcess]]:
    with ThreadPoolExecutor(2) as pool:  # both load at once
        futures = [
            pool.submit(start, tiny_llama, None, "--served-model-name", MODEL) for _ in range(2)
        ]
        servers = [future.result() for future in futures]
    try:
        yield servers
    finally:
        for server in servers:  # SIGTERM both, then wait: they drain in parallel
            server.proc.terminate()
        for server in servers:
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory) -> Iterator[Router]:
    router = Router([r.url for r in replicas], tmp_path_factory.mktemp("router") / "smg.log")
    try:
        yield router
    finally:
        router.stop()


def test_round_robin_spreads_completions_and_keeps_greedy_tokens(replicas, router):
    workers = router.wait_workers(2)
    assert sorted(w["url"] for w in workers) == sorted(r.url for r in replicas)
    assert {w["model_id"] for w in workers} == {MODEL}  # learned from /server_info, not "unknown"
    assert [m["id"] for m in httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]] == [
        MODEL
    ]

    direct = [
        httpx.post(
            f"{replicas[0].url}/v1/completions", json={**BODY, "prompt": p}, timeout=30
        ).json()
        for p in PROMPTS
    ]
    before = [requests_served(r) for r in replicas]
    routed = []
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for prompt in PROMPTS:
            reply = client.post("/v1/completions", json={**BODY, "prompt": prompt})
            assert reply.status_code == 200, reply.text
            routed.append(reply.json())
    spread = [requests_served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert spread == [len(PROMPTS) / 2] * 2, spread  # round_robin, one request at a time: alternate
    for mine, theirs in zip(routed, direct, strict=True):
        assert mine["model"] == MODEL
        assert mine["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
        assert mine["choices"][0]["text"] == theirs["choices"][0]["text"]
        assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    # not all empty
    assert sum(len(reply["choices"][0]["token_ids"]) for reply in direct) > len(PROMPTS)


def test_a_stream_through_the_router_carries_the_same_text(replicas, router):
    router.wait_workers(2)
    body = {**BODY, "prompt": PROMPTS[0]}
    whole = httpx.post(f"{replicas[1].url}/v1/completions", json=body, timeout=30).json()[
        "choices"
    ][0]
    text, tokens = "", []
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(
            "text/event-stream"
        )
        events = [
            line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        choice = orjson.loads(event)["choices"][0]
        text += choice["text"]
        tokens += choice.get("token_ids") or []
    assert (text, tokens) == (whole["text"], whole["token_ids"])


def test_objectives_in_the_body_reach_the_replica(router):
    """smg 0.3.2 forwards the body as is but not the x-slo-* headers: through it, objectives go in `slo`."""
    router.wait_workers(2)
    reply = httpx.post(
        f"{router.url}/v1/completions",
        timeout=30,
        json={**BODY, "prompt": PROMPTS[0], "slo": {"ttft_s": 1e-6}},
    )
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "deadline_passed", (
        reply.text
    )
