"""The transport-neutral front end: validate, tokenize, admit, run and account for requests."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sloserve.config import SloserveConfig
from sloserve.engine.client import EngineClient
from sloserve.engine.outputs import RequestOutput
from sloserve.errors import InvalidRequestError
from sloserve.frontend.failures import (
    Failure,
    FailureCode,
    LimitExceeded,
    RequestFailed,
    failure_from_exception,
    failure_from_output,
)
from sloserve.frontend.limits import Limits
from sloserve.frontend.metrics import Metrics
from sloserve.frontend.requests import DEFAULT_MAX_TOKENS, Event, Finished, ParsedRequest, Tokens
from sloserve.new_request import NewRequest

log = logging.getLogger(__name__)

# up to this long, encoding (~15 us) is cheaper than a thread hand-off (~90 us)
INLINE_TOKENIZE_CHARS = 256
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # the proto's int32: both edges take the same priorities


class ServerState(enum.Enum):
    """What the server can do now (mirrors the proto ServerState)."""

    LOADING = "loading"  # the model is still loading: requests are refused with not_ready
    SERVING = "serving"
    DRAINING = "draining"  # shutting down: live requests finish, new ones are refused
    ENGINE_DEAD = "engine_dead"  # the engine loop died: nothing can run; the process exits


@dataclass(slots=True)
class RequestHandle:
    """One request between the edge and the engine: cancellable before and after admission."""

    engine_id: str
    arrival: float  # time.monotonic() when the edge read the request: every time counts from here
    admitted: bool = False  # handed to the engine (in flight)
    cancelled: bool = False  # the client cancelled it
    stopped: bool = False  # ended by the edge, which reported its outcome itself


class Frontend:
    """Requests over one engine client, whatever the transport.

    Invariants: a prompt is checked once (`check`) and tokenized once, in a worker thread; a
    request counts as in flight from admission until its `run` ends, and `run` ends every
    admitted request in the engine (aborting it if it did not finish) and counts its outcome
    once in the metrics. All times count from `RequestHandle.arrival`.
    """

    def __init__(
        self, engine: EngineClient, config: SloserveConfig, metrics: Metrics | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        server = config.server
        self.limits = Limits(
            max_tokens_limit=server.max_tokens_limit,
            max_prompt_tokens=server.max_prompt_tokens,
            max_logprobs=server.max_logprobs,
            max_n=server.max_n,
            max_prompts=server.max_prompts_per_request,
            max_stop_strings=server.max_stop_strings,
            max_stop_string_chars=server.max_stop_string_chars,
            max_stop_token_ids=server.max_stop_token_ids,
        )
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- state -----------------------------------------------------------------------------
    @property
    def state(self) -> ServerState:
        if self.engine.dead_reason is not None:
            return ServerState.ENGINE_DEAD
        if self.draining:
            return ServerState.DRAINING
        return ServerState.SERVING if self.engine.ready else ServerState.LOADING

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def default_max_tokens(self) -> int:
        return min(DEFAULT_MAX_TOKENS, self.limits.max_tokens_limit)

    def start_draining(self) -> None:
        """Refuse new requests with UNAVAILABLE; live ones go on."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ---- checks ----------------------------------------------------------------------------
    def check_open(self) -> None:
        """Refuse with UNAVAILABLE while draining or before the model is loaded."""
        if self.draining:
            raise RequestFailed(
                FailureCode.UNAVAILABLE,
                "draining",
                "the server is shutting down; retry on another replica",
            )
        if not self.engine.ready:
            raise RequestFailed(
                FailureCode.UNAVAILABLE,
                "not_ready",
                "the model is still loading; retry when health says SERVING",
            )

    def check(self, parsed: ParsedRequest, prompts: Sequence[str | list[int]] = ()) -> None:
        """Every check that needs no tokenizer: the server is open, the request within limits
        (`prompts`: a batch's, each checked as `parsed`'s own, their number against the limit)."""
        self.check_open()
        max_model_len = int(self.engine.model_info.get("max_model_len") or 0)
        self.limits.check_prompts(len(prompts))
        if not prompts:
            self.limits.check_request(parsed, max_model_len)
        for i, prompt in enumerate(prompts):
            try:
                self.limits.check_request(dataclasses.replace(parsed, prompt=prompt), max_model_len)
            except LimitExceeded as exc:
                raise LimitExceeded(
                    exc.limit, f"prompt[{i}]: {exc}", code=exc.code, reason=exc.reason
                ) from None
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt[{i}]: {exc}") from None
        low, high = PRIORITY_RANGE
        if not low <= parsed.priority <= high:
            raise InvalidRequestError(
                f"priority {parsed.priority} is outside [{low}, {high}]; lower runs first"
            )

    def failure(
        self, exc: BaseException, reason: str | None = None, request: ParsedRequest | None = None
    ) -> Failure:
        """The Failure for `exc` (reason overridden if given), logged if internal and counted
        (under `request`'s SLO class when the front end ran it)."""
        failure = failure_from_exception(exc)
        if reason is not None:
            failure.reason = reason
        if failure.code == FailureCode.INTERNAL:
            log.error("request failed: %s", failure.message, exc_info=exc)
        self.count_failure(failure, request)
        return failure

    def count_failure(self, failure: Failure, request: ParsedRequest | None = None) -> None:
        if self.metrics is not None:
            self.metrics.request_failed(failure.code, failure.reason, request)
            if failure.limit is not None:
                self.metrics.limit_refused(failure.limit)

    def limit_refused(self, limit: str) -> None:
        """Count a refusal by an edge's own limit that ends no request (a stream, a connection)."""
        if self.metrics is not None:
            self.metrics.limit_refused(limit)

    # ---- one request -----------------------------------------------------------------------
    def cancel(self, handle: RequestHandle) -> None:
        """The client cancelled: abort it in the engine if admitted (its run ends 'cancelled')."""
        handle.cancelled = True
        if handle.admitted:
            self.engine.abort(handle.engine_id)

    def stop(self, handle: RequestHandle) -> None:
        """The edge ends the request and reports its outcome itself; frees it in the engine now."""
        handle.stopped = True
        if handle.admitted:
            self.engine.abort(handle.engine_id)

    async def run(self, handle: RequestHandle, parsed: ParsedRequest) -> AsyncIterator[Event]:
        """Tokenize, admit and stream one checked request: Tokens..., then Finished or a Failure.

        Close it (`contextlib.aclosing`) or cancel its task to abandon the request: it is then
        aborted in the engine and counted as cancelled, unless `stop` said the edge counts it.
        """
        finished = False
        try:
            token_ids = await self._tokens(parsed.prompt, parsed.add_special_tokens)
            if handle.cancelled:  # cancelled while tokenizing: it never reaches the engine
                finished = True
                done = Finished(
                    "cancelled", len(token_ids), 0, 0, None, None, _since(handle.arrival)
                )
                self._count_done(done, parsed)
                yield done
                return
            prediction = parsed.prediction
            if isinstance(prediction, str):
                prediction = await self._encode(prediction, False)
            self.check_open()  # again: draining may have begun while the prompt was tokenized
            stream = self.engine.add_request(
                NewRequest(
                    handle.engine_id,
                    token_ids,
                    parsed.params,
                    parsed.slo,
                    handle.arrival,
                    parsed.priority,
                    prediction,
                )
            )
            handle.admitted = True
            self._inflight += 1
            self._idle.clear()
            first: float | None = None
            last = 0.0  # when the previous tokens were delivered
            async for out in stream:
                now = _since(handle.arrival)
                behind = stream.take_ready()  # steps that queued up while we were busy: one event
                if behind:
                    out = _merge(out, behind)
                if out.new_token_ids or out.new_text or out.prompt_logprobs is not None:
                    # a prompt-only one has none
                    if first is None and (out.new_token_ids or out.new_text):
                        first = now
                        if out.first_token_time is not None:  # admission prices this backlog
                            self.engine.report_delivery_lag(time.monotonic() - out.first_token_time)
                    elif self.metrics is not None:
                        self.metrics.tokens_delivered(now - last, len(out.new_token_ids))
                    last = now
                    yield Tokens(
                        list(out.new_token_ids),
                        out.new_text or "",
                        now,
                        out.new_logprobs,
                        out.prompt_logprobs,
                        token_ids if out.prompt_logprobs is not None else None,
                    )
                if out.finished:
                    finished = True
                    yield self._outcome(out, handle.arrival, first, now, parsed)
                    return
            finished = True
            yield self.failure(
                RuntimeError("the engine ended the request without a finish reason"), request=parsed
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a Failure event
            if not finished:
                finished = True
                yield self.failure(exc, request=parsed)
        finally:
            if handle.admitted:
                # abandoned (client gone, call cancelled, shutdown): free its blocks now
                if not finished:
                    self.engine.abort(handle.engine_id)
                    if not handle.stopped and self.metrics is not None:
                        self.metrics.request_done("cancelled", request=parsed)
                self._release()

    async def _tokens(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids; a long text is tokenized in a worker thread so the event loop
        keeps serving (a short one inline: a thread hand-off costs more than encoding it)."""
        if isinstance(prompt, list):
            return prompt
        ids = await self._encode(prompt, add_special_tokens)
        self.limits.check_tokens(len(ids), int(self.engine.model_info.get("max_model_len") or 0))
        return ids

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids, a long text's in a worker thread (False: a chat template wrote the
        special tokens, or the text is a predicted output)."""
        args = (text,) if add_special_tokens else (text, False)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.engine.tokenizer.encode(*args)
        return await asyncio.to_thread(self.engine.tokenizer.encode, *args)

    def _outcome(
        self,
        out: RequestOutput,
        arrival: float,
        first: float | None,
        now: float,
        parsed: ParsedRequest,
    ) -> Finished | Failure:
        if out.finish_reason == "error":
            failure = failure_from_output(out)
            if failure.code == FailureCode.INTERNAL:
                log.error("request %s failed: %s", out.request_id, failure.message)
            self.count_failure(failure, parsed)
            return failure
        queue_s = None
        if out.first_scheduled_time is not None:
            queue_s = min(
                max(0.0, out.first_scheduled_time - arrival), first if first is not None else now
            )
        done = Finished(
            out.finish_reason or "unknown",
            out.num_prompt_tokens or 0,
            out.num_output_tokens or 0,
            out.num_cached_tokens or 0,
            queue_s,
            first,
            now,
            out.accepted_prediction_tokens if parsed.prediction is not None else None,
            out.rejected_prediction_tokens if parsed.prediction is not None else None,
        )
        self._count_done(done, parsed)
        return done

    def _count_done(self, done: Finished, parsed: ParsedRequest) -> None:
        if self.metrics is not None:
            self.metrics.request_done(done.finish_reason, done, parsed)

    def _release(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()


def _merge(out: RequestOutput, behind: list[RequestOutput]) -> RequestOutput:
    """One output carrying the tokens and text of `out` and the outputs queued behind it (the last
    one's status and times)."""
    last, every = behind[-1], (out, *behind)
    logprobs = (
        None if out.new_logprobs is None else [e for o in every for e in o.new_logprobs or ()]
    )
    prompt = next((o.prompt_logprobs for o in every if o.prompt_logprobs is not None), None)
    return dataclasses.replace(
        last,
        new_token_ids=[t for o in every for t in o.new_token_ids],
        new_text="".join(o.new_text or "" for o in every),
        new_logprobs=logprobs,
        prompt_logprobs=prompt,
    )


def _since(arrival: float) -> float:
    return max(0.0, time.monotonic() - arrival)
