"""Asyncio load generator over sloserve's OpenAI-compatible HTTP API (streamed /v1/completions).

The same workloads, arrival process (sloserve.bench.driver) and records as the gRPC client, so
both protocols are measured by one tool: a chunk's time is when its SSE event is read, its token
count comes from the `return_token_ids` extension, the usage chunk gives the final counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import orjson
from sloserve.bench.client import LoadSpec, RunResult
from sloserve.bench.driver import drive
from sloserve.bench.record import RequestRecord
from sloserve.bench.workloads import WorkloadItem
from sloserve.sampling_params import SLO

CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}  # the gRPC names, to compare runs


def open_client(
    url: str, auth_token: str | None, connect_timeout_s: float = 10.0
) -> aiohttp.ClientSession:
    """A pooled keep-alive session (aiohttp, as vLLM's `bench serve` uses); call inside the event loop."""
    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    return aiohttp.ClientSession(
        base_url=url.rstrip("/") + "/",
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        connector=aiohttp.TCPConnector(limit=0),
    )


_SHORT = aiohttp.ClientTimeout(total=10.0)


async def wait_ready(client: aiohttp.ClientSession, timeout_s: float) -> None:
    """Poll GET /health until 200; ConnectionError when unreachable or not ready within timeout_s."""
    deadline = time.monotonic() + timeout_s
    reached = False
    while True:
        try:
            async with client.get("health", timeout=_SHORT) as reply:
                if reply.status == 200:
                    return
            reached = True
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.monotonic() >= deadline:
            if not reached:
                raise ConnectionError(
                    f"cannot reach a sloserve HTTP API at {client.base_url} within "
                    f"{timeout_s:g} s: check --url and that the server is running"
                )
            raise ConnectionError(
                f"the server is reachable but not ready after {timeout_s:g} s "
                "(model still loading?): raise --ready-timeout"
            )
        await asyncio.sleep(0.5)


async def fetch_info(client: aiohttp.ClientSession) -> dict:
    """The served model's id and context length from /v1/models ({} if it does not answer)."""
    try:
        async with client.get("v1/models", timeout=_SHORT) as reply:
            model = orjson.loads(await reply.read())["data"][0]
        async with client.get("version", timeout=_SHORT) as reply:
            version = orjson.loads(await reply.read()).get("version", "")
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return {}
    return {
        "model": model.get("id"),
        "max_model_len": model.get("max_model_len"),
        "version": version,
        "protocol": "http",
    }


def build_request(
    request_id: str, item: WorkloadItem, spec: LoadSpec, slo: SLO | None
) -> tuple[str, dict, dict]:
    """(request id, JSON body, headers) of one streamed completion; objectives in x-slo-* headers."""
    body = {
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": item.ignore_eos or spec.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if item.priority is not None:
        body["priority"] = item.priority
    if spec.grammar is not None:
        body["structured_outputs"] = {"grammar": spec.grammar}
    headers = {"x-request-id": request_id}
    if slo is not None:
        for name, header in (
            ("ttft_s", "x-slo-ttft-ms"),
            ("tpot_s", "x-slo-tpot-ms"),
            ("e2e_s", "x-slo-e2e-ms"),
        ):
            if (value := getattr(slo, name)) is not None:
                headers[header] = f"{value * 1e3:g}"
    return request_id, body, headers


class _HttpConn:
    """Requests over one pooled HTTP client: one task per request, reading its SSE stream."""

    def __init__(self, client: aiohttp.ClientSession, model: str | None) -> None:
        self._client = client
        self._model = model
        self._pending: dict[str, tuple[RequestRecord, asyncio.Future, asyncio.Task]] = {}

    async def send(self, request: tuple[str, dict, dict], record: RequestRecord) -> asyncio.Future:
        request_id, body, headers = request
        if self._model:
            body["model"] = self._model
        done = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._run(request_id, body, headers, record))
        self._pending[request_id] = (record, done, task)
        return done

    async def _run(self, request_id: str, body: dict, headers: dict, record: RequestRecord) -> None:
        record.send_time = time.perf_counter()
        try:
            async with self._client.post(
                "v1/completions",
                data=orjson.dumps(body),
                headers={**headers, "content-type": "application/json"},
            ) as reply:
                if reply.status != 200:
                    error = _error(await reply.read())
                    self._finish(
                        request_id,
                        "refused",
                        CODES.get(reply.status, f"HTTP_{reply.status}"),
                        error.get("code"),
                    )
                    return
                async for line in reply.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        break
                    if not self._chunk(request_id, record, orjson.loads(line[6:])):
                        return
            self._finish(request_id, "ok", None, None)
        except (aiohttp.ClientError, TimeoutError):
            self._finish(request_id, "failed", "UNAVAILABLE", "stream_lost")

    def _chunk(self, request_id: str, record: RequestRecord, chunk: dict) -> bool:
        """File one SSE chunk; False when it was an error event (the request is over)."""
        if "error" in chunk:
            status = chunk["error"].get("type", "")
            self._finish(
                request_id,
                "refused",
                "UNAVAILABLE" if "unavailable" in status else "INTERNAL",
                chunk["error"].get("code"),
            )
            return False
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids")
            text = choice.get("text") or ""
            if ids or text:
                record.chunk_times.append(time.perf_counter())
                record.chunk_tokens.append(len(ids) if ids is not None else 1)
                record.text += text
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if usage := chunk.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens", 0)
            record.output_tokens = usage.get("completion_tokens", 0)
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            )
        return True

    def _finish(self, request_id: str, status: str, code: str | None, reason: str | None) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        record, done, _ = entry
        record.end_time = time.perf_counter()
        record.status = status
        record.error_code = code
        record.error_reason = reason
        if status == "ok" and not record.output_tokens:
            record.output_tokens = sum(record.chunk_tokens)
        if not done.done():
            done.set_result(record)

    async def give_up(self, request_id: str) -> None:
        """Cancel a request that ran past the client's timeout (closing it aborts it on the server)."""
        entry = self._pending.get(request_id)
        self._finish(request_id, "failed", "DEADLINE_EXCEEDED", "client_timeout")
        if entry is not None:
            entry[2].cancel()

    async def close(self) -> None:
        tasks = [entry[2] for entry in self._pending.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _error(raw: bytes) -> dict:
    try:
        return orjson.loads(raw).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return {}


async def run_load(
    client: aiohttp.ClientSession,
    items: list[WorkloadItem],
    spec: LoadSpec,
    on_done: Callable[[RequestRecord], None] | None = None,
    id_prefix: str = "bench",
    model: str | None = None,
) -> RunResult:
    """Send the workload as spec says over HTTP and record every request; never raises for a request."""
    if not items:
        raise ValueError("the workload holds no requests")
    records, duration_s = await drive(
        [_HttpConn(client, model)], items, spec, build_request, on_done, id_prefix
    )
    return RunResult(spec.rate, records, duration_s)
