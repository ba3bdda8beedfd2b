"""Per-token post-processing: stop conditions, detokenized text and the deltas streamed out."""

from __future__ import annotations

from sloserve.engine.outputs import RequestOutput
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.stop_strings import StopMatcher
from sloserve.logprobs import Logprob


def process_token(req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int,
                  logprob: Logprob | None = None) -> None:
    """Append a sampled token (and its logprobs, when asked), extend the text and set a FINISHED_*
    status if a stop condition holds.

    Order: EOS (unless ignore_eos) and stop token ids end the request without adding text; a stop
    string ends it with the text cut just before the string; then max_tokens and the context
    length give 'length'. Before min_tokens outputs, no stop condition but length applies.
    """
    req.append_token(token)
    if req.output_logprobs is not None and logprob is not None:
        req.output_logprobs.append(logprob)
    params = req.sampling
    early = req.num_output_tokens < params.min_tokens
    if not early and params.stops_on(token, eos_token_ids):
        req.status = RequestStatus.FINISHED_STOPPED
        _flush_text(req)
        return
    if req.detokenizer is not None:
        before = len(req.output_text)
        req.output_text += req.detokenizer.add(token)
        if params.stop and not early and _cut_at_stop_string(req, before):
            req.status = RequestStatus.FINISHED_STOPPED
            return
    if req.num_output_tokens >= params.max_tokens or req.num_tokens >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH
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


def keep_prompt_logprobs(req: Request, runs: list[tuple[int, list[Logprob]]]) -> None:
    """Store the prompt positions' logprobs the runner computed (a recompute after preemption
    computes them again: the first ones stay)."""
    if req.prompt_logprobs is None:
        return
    for first, entries in runs:
        for position, entry in enumerate(entries, first):
            if position < len(req.prompt_logprobs) and req.prompt_logprobs[position] is None:
                req.prompt_logprobs[position] = entry


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
