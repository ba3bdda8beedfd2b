"""The engine's output stage: detokenized text, stop strings and the deltas streamed out.

It runs after the scheduler has applied a step's tokens (the scheduler stops requests on stop
tokens and length only): each new token is turned into text in order, and a stop string ends
its request there, the step's later tokens dropped (Scheduler.stop_early), exactly as if the
string had been matched while the tokens were applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sloserve.engine.detokenizer import IncrementalDetokenizer
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.stop_strings import StopMatcher
from sloserve.sched.request import Request, RequestStatus
from sloserve.sched.scheduler import Scheduler


class OutputProcessor:
    """Turns the requests a step moved into RequestOutputs, their text included."""

    def __init__(self, decode: Callable[[list[int]], str] | None, eos_token_ids: Sequence[int] = (),
                 on_token: Callable[[str], None] | None = None) -> None:
        """`on_token(request_id)` runs before each new token is processed (the test-only fault hook)."""
        self._decode = decode
        self._eos_token_ids = frozenset(eos_token_ids)
        self._on_token = on_token

    def process(self, requests: Iterable[Request], scheduler: Scheduler) -> list[RequestOutput]:
        """The outputs of `requests`; one request's failure finishes it alone with 'error'."""
        outputs = []
        for req in requests:
            try:
                self._add_text(req, scheduler)
            except Exception as exc:  # one request's failure must not fail the batch
                scheduler.stop_early(req, req.text_token_len, RequestStatus.FINISHED_ERROR,
                                     f"{type(exc).__name__}: {exc}")
            outputs.append(take_output(req))
        return outputs

    def _add_text(self, req: Request, scheduler: Scheduler) -> None:
        """Detokenize the output tokens not yet seen; a stop string completed by one of them ends
        `req` there, with the text cut just before the string.

        Before min_tokens outputs no stop condition applies; a stop token (ended by the
        scheduler) adds no text; a request ended by length flushes what the detokenizer holds.
        """
        tokens = req.output_token_ids
        if req.text_token_len >= len(tokens):
            return
        if req.detokenizer is None and self._decode is not None:
            req.detokenizer = IncrementalDetokenizer(self._decode, req.prompt_token_ids)
        params = req.sampling
        for i in range(req.text_token_len, len(tokens)):
            if self._on_token is not None:
                self._on_token(req.request_id)
            req.text_token_len = i + 1
            token = tokens[i]
            early = i + 1 < params.min_tokens
            if not early and params.stops_on(token, self._eos_token_ids):
                _flush_text(req)
                return
            if req.detokenizer is not None:
                before = len(req.output_text)
                req.output_text += req.detokenizer.add(token)
                if params.stop and not early and _cut_at_stop_string(req, before):
                    scheduler.stop_early(req, i + 1, RequestStatus.FINISHED_STOPPED)
                    return
        if req.status == RequestStatus.FINISHED_LENGTH:
            _flush_text(req)


def _flush_text(req: Request) -> None:
    if req.detokenizer is None:
        return
    before = len(req.output_text)
    req.output_text += req.detokenizer.flush()
    if req.sampling.stop:
        _cut_at_stop_string(req, before)


def _cut_at_stop_string(req: Request, before: int) -> bool:
    """Truncate the text before the earliest stop string that the new text completed.

    The automaton is built at the request's first text (so only requests that run hold one)
    and fed each piece of text once, so the work per token does not grow with the strings.
    """
    if req.stop_matcher is None:
        req.stop_matcher = StopMatcher(req.sampling.stop)
    start = req.stop_matcher.feed(req.output_text[before:])
    if start is None:
        return False
    req.output_text = req.output_text[:start]
    return True


def take_output(req: Request) -> RequestOutput:
    """The tokens and text not yet streamed; with stop strings, the last len-1 chars wait until known safe."""
    text_end = len(req.output_text)
    if req.stop_matcher is not None and not req.is_finished:
        text_end = max(req.sent_text_len, text_end - (req.stop_matcher.max_len - 1))
    new_text = req.output_text[req.sent_text_len:text_end]
    req.sent_text_len = text_end
    new_ids = req.output_token_ids[req.sent_token_len:]
    new_logprobs = None if req.output_logprobs is None else req.output_logprobs[req.sent_token_len:]
    prompt_logprobs = None
    scored = req.sampling.prompt_only and req.status == RequestStatus.FINISHED_LENGTH  # its prompt, whole
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and (new_ids or scored):
        prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
    req.sent_token_len = req.num_output_tokens
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=new_ids,
        new_text=new_text,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        error=req.error,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        finish_time=req.finish_time,
        refusal_reason=req.refusal_reason,
        error_kind="refused" if req.refusal_reason else None,
        new_logprobs=new_logprobs,
        prompt_logprobs=prompt_logprobs,
    )
