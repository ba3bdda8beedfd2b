"""A Stream that writes slower than tokens come: one waiting chunk per request absorbs them."""

from __future__ import annotations

import asyncio

import pytest
from sloserve.frontend.requests import Finished, Tokens
from sloserve.grpc.session import StreamSession
from sloserve.pb import serving_pb2 as pb

pytestmark = pytest.mark.timeout(30)


class _Context:
    def time_remaining(self) -> None:
        return None


class _Frontend:
    """Yields five Tokens events then a Finished for every request, as fast as it can."""

    default_max_tokens = 16

    def check(self, parsed) -> None:
        pass

    async def run(self, handle, parsed):
        for i in range(5):
            yield Tokens([100 + i], chr(100 + i), 0.01 * (i + 1))
            await asyncio.sleep(0)
        yield Finished("length", 3, 5, 0, 0.0, 0.01, 0.05)


async def _drain(session: StreamSession) -> list[pb.ServerMessage]:
    msgs = []
    while not session.out.empty():
        msgs.append(await session.next_message())
    return msgs


async def test_tokens_that_arrive_while_the_stream_is_busy_join_the_waiting_chunk():
    session = StreamSession(_Frontend(), _Context())
    for rid in ("a", "b"):
        session.generate(pb.GenerateRequest(request_id=rid, text="hi"), arrival=0.0)
    # nothing written yet
    await asyncio.gather(*(entry.task for entry in list(session.live.values())))
    msgs = await _drain(session)
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    assert [(c.request_id, list(c.token_ids), c.text, c.time_s) for c in chunks] == [
        ("a", [100, 101, 102, 103, 104], "defgh", 0.01),
        ("b", [100, 101, 102, 103, 104], "defgh", 0.01),
    ]
    finals = [m.final for m in msgs if m.HasField("final")]
    assert [f.request_id for f in finals] == ["a", "b"]
    # the terminal still comes after every token of its request
    assert [
        m.WhichOneof("kind") for m in msgs if m.chunk.request_id == "a" or m.final.request_id == "a"
    ] == ["chunk", "final"]


async def test_a_reused_id_never_joins_the_previous_requests_chunk():
    session = StreamSession(_Frontend(), _Context())
    session.generate(pb.GenerateRequest(request_id="r", text="hi"), arrival=0.0)
    await session.live["r"].task
    session.generate(pb.GenerateRequest(request_id="r", text="again"), arrival=0.0)
    await session.live["r"].task
    msgs = await _drain(session)
    assert [m.WhichOneof("kind") for m in msgs] == ["chunk", "final", "chunk", "final"]
    assert [len(m.chunk.token_ids) for m in msgs if m.HasField("chunk")] == [5, 5]


async def test_a_chunk_taken_for_writing_accepts_no_more_tokens():
    session = StreamSession(_Frontend(), _Context())
    session.generate(pb.GenerateRequest(request_id="w", text="hi"), arrival=0.0)
    first = await session.next_message()  # the writer takes the first chunk at once
    await session.live["w"].task
    rest = await _drain(session)
    assert list(first.chunk.token_ids) == [100]
    assert [list(m.chunk.token_ids) for m in rest if m.HasField("chunk")] == [[101, 102, 103, 104]]
