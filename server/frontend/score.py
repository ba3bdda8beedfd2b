"""Scoring candidates over the front end, whatever the transport: one engine request each.

Every candidate's request (sloserve.score) is in flight at once; the first to start computes the
prompt and claims its blocks, the others wait for them and take them from the prefix cache.
Abandoning the call (cancelling its task) aborts every candidate still in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from sloserve.frontend.failures import Failure, FailureCode
from sloserve.frontend.frontend import Frontend, RequestHandle
from sloserve.frontend.requests import Finished, ParsedRequest, Tokens
from sloserve.logprobs import Logprob
from sloserve.sampling_params import SLO
from sloserve.score import ScoreOutput, check_candidates, score_of, score_params

CANCELLED = Failure(
    FailureCode.UNAVAILABLE,
    "cancelled",
    "a candidate's request was cancelled (the server is shutting down) before it was scored",
)


@dataclass(slots=True)
class ScoreCall:
    """A score call as a transport read it: token ids or texts, not yet tokenized."""

    prompt: str | list[int]
    candidates: list[str | list[int]]
    top_logprobs: int


async def run_score(
    frontend: Frontend, engine_id: str, arrival: float, call: ScoreCall, slo: SLO | None
) -> tuple[int, list[ScoreOutput]] | Failure:
    """(prompt tokens, each candidate's score), one engine request per candidate, all in flight
    together; InvalidRequestError names a prompt or candidate that cannot be scored; the first
    Failure if any fails (the others are then abandoned, which aborts them in the engine)."""
    tokenizer = frontend.engine.tokenizer
    prompt = (
        await asyncio.to_thread(tokenizer.encode, call.prompt)
        if isinstance(call.prompt, str)
        else call.prompt
    )
    # NOTE: a text candidate is tokenized alone, as LLM.score does
    candidates = [tokenizer.encode(c, False) if isinstance(c, str) else c for c in call.candidates]
    max_model_len = int(frontend.engine.model_info.get("max_model_len") or 0)
    check_candidates(prompt, candidates, max_model_len, frontend.config.server.max_score_candidates)
    for candidate in candidates:  # --max-prompt-tokens holds for each candidate's request
        frontend.limits.check_tokens(len(prompt) + len(candidate), max_model_len)
    params = score_params(len(prompt), call.top_logprobs)
    tasks = [
        asyncio.create_task(
            _one(
                frontend,
                i,
                RequestHandle(f"{engine_id}-{i}", arrival),
                ParsedRequest(prompt + c, params, slo),
            )
        )
        for i, c in enumerate(candidates)
    ]
    found: dict[int, tuple[list[Logprob | None] | None, int]] = {}
    try:
        for task in asyncio.as_completed(tasks):
            outcome = await task
            if isinstance(outcome, Failure):
                return outcome
            index, logprobs, cached = outcome
            found[index] = logprobs, cached
    finally:
        for task in tasks:
            task.cancel()
    return len(prompt), [
        score_of(c, found[i][0], call.top_logprobs, found[i][1]) for i, c in enumerate(candidates)
    ]


async def _one(
    frontend: Frontend, index: int, handle: RequestHandle, parsed: ParsedRequest
) -> tuple[int, list[Logprob | None] | None, int] | Failure:
    """(candidate index, its prompt logprobs, cached tokens) of one candidate's request, or why not."""
    logprobs = None
    async with contextlib.aclosing(frontend.run(handle, parsed)) as events:
        async for event in events:
            if isinstance(event, Tokens) and event.prompt_logprobs is not None:
                logprobs = event.prompt_logprobs
            elif isinstance(event, Failure):
                return event
            elif isinstance(event, Finished) and event.finish_reason != "cancelled":
                return index, logprobs, event.cached_tokens
    return CANCELLED
