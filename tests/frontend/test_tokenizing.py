"""Text prompts are tokenized once, a long one in a worker thread: the event loop keeps serving meanwhile."""

from __future__ import annotations

import threading

import grpc
import pytest
from sloserve.frontend.frontend import INLINE_TOKENIZE_CHARS
from sloserve.frontend.limits import MAX_CHARS_PER_TOKEN
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, cancel, gen, live_server, read_until, wait_for
from sloserve.testing.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)

SLOW = "tokenize me " * 30  # longer than INLINE_TOKENIZE_CHARS: tokenized in a worker thread
NEVER = "never runs " * 30
assert len(SLOW) > INLINE_TOKENIZE_CHARS and len(NEVER) > INLINE_TOKENIZE_CHARS


class GatedTokenizer(ByteTokenizer):
    """Blocks every encode() until `gate` is set; records the thread of each call."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().encode(text)


class RecordingEngine(FakeEngine):
    """Records the prompt each add_request received."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.prompts: dict[str, object] = {}

    def add_request(self, new):
        self.prompts[new.request_id.split(":", 1)[1]] = new.token_ids  # keyed by the client's id
        return super().add_request(new)


@pytest.fixture
def gated():
    engine = RecordingEngine(step_s=0.002, max_model_len=1024)
    engine.tokenizer = tok = GatedTokenizer()
    yield engine, tok
    tok.gate.set()  # never leave a worker thread blocked


async def test_the_loop_keeps_serving_while_a_prompt_is_tokenized(gated):
    engine, tok = gated
    async with live_server(engine) as (_, stub, _):
        call = stub.Stream()
        await call.write(gen("slow", text=SLOW, max_tokens=3))
        await wait_for(tok.entered.is_set)
        # encode() is blocked, yet other calls are answered and the stream reader still reads
        assert (await stub.Info(pb.InfoRequest())).max_model_len == engine.max_model_len
        await call.write(gen("slow", text="again", max_tokens=3))
        dup = (await call.read()).error
        assert dup.request_id == "" and dup.reason == "duplicate_id" and "'slow'" in dup.message, (
            dup
        )
        assert tok.threads[0] != threading.get_ident()
        assert "slow" not in engine.prompts
        tok.gate.set()
        transcript = Transcript()
        await read_until(call, transcript, {"slow"})
        await call.done_writing()
        final = transcript.terminal("slow").final
        assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == (
            pb.FINISH_REASON_LENGTH,
            len(SLOW),
            3,
        )
        assert "".join(c.text for c in transcript.chunks("slow")) == "".join(
            map(chr, transcript.tokens("slow"))
        )
    assert engine.prompts == {
        "slow": list(SLOW.encode())
    }  # the engine got token ids: no second encode
    assert len(tok.threads) == 1


async def test_cancel_while_tokenizing_ends_with_cancelled_and_never_reaches_the_engine(gated):
    engine, tok = gated
    async with live_server(engine) as (server, stub, _):
        call = stub.Stream()
        await call.write(gen("c", text=NEVER, max_tokens=5))
        await wait_for(tok.entered.is_set)
        await call.write(cancel("c"))
        # answered in order: once this reply is here, "c" was cancelled
        await call.write(cancel("nobody"))
        assert (await call.read()).error.reason == "unknown_id"
        tok.gate.set()
        final = (await call.read()).final
        assert (
            final.request_id,
            final.finish_reason,
            final.prompt_tokens,
            final.completion_tokens,
        ) == ("c", pb.FINISH_REASON_CANCELLED, len(NEVER), 0)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert engine.prompts == {} and server.frontend.inflight == 0


async def test_the_prompt_token_limit_is_checked_on_the_tokenized_prompt(gated):
    engine, tok = gated
    tok.gate.set()
    async with live_server(engine, max_prompt_tokens=4) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(request_id="g", text="12345")):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "5 tokens, over this server's limit of 4" in info.value.details()
        msgs = [
            m
            async for m in stub.Generate(
                pb.GenerateRequest(request_id="ok", text="1234", max_tokens=2)
            )
        ]
        assert msgs[-1].final.prompt_tokens == 4
    assert engine.prompts == {"ok": list(b"1234")} and len(tok.threads) == 2


async def test_a_text_far_over_the_context_is_refused_before_tokenizing(gated):
    engine, tok = gated  # the gate stays shut: tokenizing would hang the request
    limit = engine.max_model_len * MAX_CHARS_PER_TOKEN
    async with live_server(engine) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(
                pb.GenerateRequest(request_id="big", text="y" * (limit + 1))
            ):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            f"{limit + 1} characters, over this server's limit of {limit}" in info.value.details()
        )
        call = stub.Stream()
        await call.write(gen("big", text="y" * (limit + 1)))
        err = (await call.read()).error
        assert (
            err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            and f"limit of {limit}" in err.message
        )
        await call.done_writing()
    assert tok.threads == [] and engine.prompts == {}


async def test_a_short_prompt_is_tokenized_inline(gated):
    engine, tok = gated
    tok.gate.set()
    async with live_server(engine) as (_, stub, _):
        msgs = [
            m
            async for m in stub.Generate(
                pb.GenerateRequest(request_id="s", text="short", max_tokens=2)
            )
        ]
        assert msgs[-1].final.prompt_tokens == len("short")
    # the event loop's thread: no hand-off for 5 characters
    assert tok.threads == [threading.get_ident()]
