"""A tiny real grpc.aio sloserve server with canned token timing, for testing the bench client."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc


@dataclass
class FakeBehaviour:
    """Canned behaviour: first-token delay, per-token delay, answers, refusals, limits."""

    ttft_s: float = 0.01
    token_s: float = 0.002
    # prompt -> text to stream (one char per token)
    answers: dict[str, str] = field(default_factory=dict)
    refuse_prefix: str = "REFUSE"  # prompts starting with this get RESOURCE_EXHAUSTED
    max_in_flight: int = 1000  # beyond this, refuse with reason 'queue_full'
    cached_tokens: int = 3
    seen: list[pb.GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


class FakeSloserve(pb_grpc.SloserveServicer):
    """Streams max_tokens one-character tokens (or the canned answer) per request."""

    def __init__(self, behaviour: FakeBehaviour) -> None:
        self.b = behaviour
        self.in_flight = 0

    async def Info(self, request, context):
        return pb.InfoResponse(
            model="fake", architecture="FakeForCausalLM", device="cpu", max_model_len=4096
        )

    async def Stream(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def generate(req: pb.GenerateRequest, arrival: float) -> None:
            self.in_flight += 1
            try:
                text = self.b.answers.get(req.text, "x" * (req.max_tokens or 64))[
                    : req.max_tokens or 64
                ]
                await asyncio.sleep(self.b.ttft_s)
                first = time.perf_counter()
                for i, ch in enumerate(text):
                    if i:
                        await asyncio.sleep(self.b.token_s)
                    await out.put(
                        pb.ServerMessage(
                            chunk=pb.TokenChunk(
                                request_id=req.request_id,
                                token_ids=[ord(ch)],
                                text=ch,
                                time_s=time.perf_counter() - arrival,
                            )
                        )
                    )
                end = time.perf_counter()
                await out.put(
                    pb.ServerMessage(
                        final=pb.Final(
                            request_id=req.request_id,
                            finish_reason=pb.FINISH_REASON_LENGTH,
                            prompt_tokens=len(req.text),
                            completion_tokens=len(text),
                            cached_prompt_tokens=min(self.b.cached_tokens, len(req.text)),
                            ttft_s=first - arrival,
                            e2e_s=end - arrival,
                        )
                    )
                )
            except asyncio.CancelledError:
                await out.put(
                    pb.ServerMessage(
                        final=pb.Final(
                            request_id=req.request_id, finish_reason=pb.FINISH_REASON_CANCELLED
                        )
                    )
                )
            finally:
                self.in_flight -= 1
                tasks.pop(req.request_id, None)

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "cancel":
                    self.b.cancelled.append(message.cancel.request_id)
                    task = tasks.get(message.cancel.request_id)
                    if task is not None:
                        task.cancel()
                    continue
                req = message.generate
                self.b.seen.append(req)
                if (
                    req.text.startswith(self.b.refuse_prefix)
                    or self.in_flight >= self.b.max_in_flight
                ):
                    reason = (
                        "slo_unattainable"
                        if req.text.startswith(self.b.refuse_prefix)
                        else "queue_full"
                    )
                    await out.put(
                        pb.ServerMessage(
                            error=pb.RequestError(
                                request_id=req.request_id,
                                code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                message="refused by the fake",
                                reason=reason,
                            )
                        )
                    )
                    continue
                tasks[req.request_id] = asyncio.create_task(generate(req, time.perf_counter()))
            while tasks:
                await asyncio.sleep(0.005)
            await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (message := await out.get()) is not None:
                yield message
        finally:
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()


async def start_fake(behaviour: FakeBehaviour) -> tuple[grpc.aio.Server, str]:
    """Start the fake on 127.0.0.1 with an OS-chosen port; returns (server, 'host:port')."""
    server = grpc.aio.server()
    pb_grpc.add_SloserveServicer_to_server(FakeSloserve(behaviour), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class FakeThread:
    """The fake on its own event loop in a daemon thread (for code that runs its own asyncio.run);
    wait_ready returns its Info as sloserve.bench.client.fetch_info gives it."""

    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._server, self.target = self._loop.run_until_complete(start_fake(self.behaviour))
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert started.wait(10), "the fake server did not start"

    def wait_ready(self, timeout_s: float = 10.0) -> dict:
        return {"model": "fake", "device": "cpu", "max_model_len": 4096}

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FakeThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
