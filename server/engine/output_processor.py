"""The engine's output stage: detokenized text, stop strings and the deltas streamed out.

It runs after the scheduler has applied a step's tokens (the scheduler stops requests on stop
tokens and length only): each new token is turned into text in order, and a stop string ends
its request there, the step's later tokens dropped (Scheduler.stop_early), exactly as if the
string had been matched while the tokens were applied. The text of a request lives here, from
its first output until it finishes; the scheduler's Request holds only tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sloserve.engine.detokenizer import IncrementalDetokenizer
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.stop_strings import StopMatcher
from sloserve.sched.request import Request, RequestStatus
from sloserve.sched.scheduler import Scheduler


@dataclass(slots=True)
class RequestText:
    """One live request's text: what it has produced, streamed and matched so far."""

    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopMatcher | None = None  # built from sampling.stop at the first text
    text: str = ""
    sent: int = 0  # characters already streamed
    tokens: int = 0  # output tokens already turned into text


class OutputProcessor:
    """Turns the requests a step moved into RequestOutputs, their text included."""

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self._decode = decode
        self._texts: dict[str, RequestText] = {}  # live requests that have had an output

    @property
    def live(self) -> int:
        """Requests whose text is kept (each until it finishes)."""
        return len(self._texts)

    def process(self, requests: Iterable[Request], scheduler: Scheduler) -> list[RequestOutput]:
        """The outputs of `requests`; one request's failure finishes it alone with 'error'."""
        outputs = []
        for req in requests:
            state = self._texts.get(req.request_id)
            if state is None:
                detokenizer = (
                    None
                    if self._decode is None
                    else IncrementalDetokenizer(self._decode, req.prompt_token_ids)
                )
                state = self._texts[req.request_id] = RequestText(detokenizer)
            try:
                self._add_text(req, state, scheduler)
            except Exception as exc:  # one request's failure must not fail the batch
                scheduler.stop_early(
                    req, state.tokens, RequestStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}"
                )
            outputs.append(_take_output(req, state))
            if req.is_finished:
                del self._texts[req.request_id]
        return outputs

    def _add_text(self, req: Request, state: RequestText, scheduler: Scheduler) -> None:
        """Detokenize the output tokens not yet seen; a stop string completed by one of them ends
        `req` there, with the text cut just before the string.

        Before min_tokens outputs no stop string applies; the stop token that the scheduler ended
        `req` on (always its last) adds no text; a request ended by length flushes what the
        detokenizer holds.
        """
        tokens = req.output_token_ids
        if state.tokens >= len(tokens):
            return
        params = req.sampling
        stop_token = len(tokens) - 1 if req.status == RequestStatus.FINISHED_STOPPED else None
        for i in range(state.tokens, len(tokens)):
            state.tokens = i + 1
            token = tokens[i]
            early = i + 1 < params.min_tokens
            if i == stop_token:
                _flush_text(state, params.stop)
                return
            if state.detokenizer is not None:
                before = len(state.text)
                state.text += state.detokenizer.add(token)
                if params.stop and not early and _cut_at_stop_string(state, params.stop, before):
                    scheduler.stop_early(req, i + 1, RequestStatus.FINISHED_STOPPED)
                    return
        if req.status == RequestStatus.FINISHED_LENGTH:
            _flush_text(state, params.stop)


def _flush_text(state: RequestText, stop: list[str] | None) -> None:
    if state.detokenizer is None:
        return
    before = len(state.text)
    state.text += state.detokenizer.flush()
    if stop:
        _cut_at_stop_string(state, stop, before)


def _cut_at_stop_string(state: RequestText, stop: list[str], before: int) -> bool:
    """Truncate the text before the earliest stop string that the new text completed.

    The automaton is built at the request's first text (so only requests that run hold one)
    and fed each piece of text once, so the work per token does not grow with the strings.
    """
    if state.stop_matcher is None:
        state.stop_matcher = StopMatcher(stop)
    start = state.stop_matcher.feed(state.text[before:])
    if start is None:
        return False
    state.text = state.text[:start]
    return True


def _take_output(req: Request, state: RequestText) -> RequestOutput:
    """The tokens and text not yet streamed; with stop strings, the last len-1 chars wait until known safe."""
    text_end = len(state.text)
    if state.stop_matcher is not None and not req.is_finished:
        text_end = max(state.sent, text_end - (state.stop_matcher.max_len - 1))
    new_text = state.text[state.sent : text_end]
    state.sent = text_end
    new_ids = req.output_token_ids[req.sent_token_len :]
    new_logprobs = (
        None if req.output_logprobs is None else req.output_logprobs[req.sent_token_len :]
    )
    prompt_logprobs = None
    # its prompt, whole
    scored = req.sampling.prompt_only and req.status == RequestStatus.FINISHED_LENGTH
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
        error_kind="refused" if req.refusal_reason else req.error_kind,
        new_logprobs=new_logprobs,
        prompt_logprobs=prompt_logprobs,
        num_drafted_tokens=req.num_drafted,
        num_accepted_tokens=req.num_accepted,
        accepted_prediction_tokens=req.prediction_accepted,
        rejected_prediction_tokens=req.prediction_rejected,
    )
