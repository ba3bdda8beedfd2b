"""n > 1 or a list of prompts: a request's choices run as engine requests of their own, combined
into one response (or one stream) with choices[0..P*n-1], prompt-major as OpenAI orders them
(choice p*n + j is prompt p's j-th).

A prompt is computed once: its n choices share its full KV blocks through the prefix cache (the
first computes a block, the others wait for it and take it, see Scheduler._admit_waiting). A
seeded request gives choice j of each prompt the seed + j, as vLLM does, so the choices differ.
Each choice counts as a request in the metrics. The first failure ends the whole request with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from sloserve.frontend import Failure, Finished, ParsedRequest, RequestHandle, Tokens
from sloserve.http import sse
from sloserve.http.errors import STATUS, error_body, failure_response
from sloserve.http.responses import Shape, prediction_details
from sloserve.http.schemas import CompletionRequest
from starlette.responses import Response


def choice_request(parsed: ParsedRequest, index: int) -> ParsedRequest:
    """Choice `index`'s request: the same prompt, its own seed when seeded."""
    params = parsed.params
    if params.seed is not None and index:
        params = dataclasses.replace(params, seed=(params.seed + index) % 2**63)
    return dataclasses.replace(parsed, params=params, n=1)


class Choices:
    """The engine requests of one HTTP request (n per prompt), their events merged into one queue."""

    def __init__(self, owner: Any, handle: RequestHandle, req: CompletionRequest) -> None:
        self.owner = owner
        n = req.parsed.n
        requests = [
            choice_request(req.for_prompt(p), j)
            for p in range(len(req.prompts or ()) or 1)
            for j in range(n)
        ]
        self.handles = [
            RequestHandle(f"{handle.engine_id}-{i}", handle.arrival) for i in range(len(requests))
        ]
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        for h in self.handles:
            owner.live[h.engine_id] = h
        self.tasks = [
            asyncio.create_task(self._pump(i, h, parsed))
            for i, (h, parsed) in enumerate(zip(self.handles, requests, strict=True))
        ]

    async def _pump(self, index: int, handle: RequestHandle, parsed: ParsedRequest) -> None:
        async with contextlib.aclosing(self.owner.frontend.run(handle, parsed)) as events:
            async for event in events:
                await self.queue.put((index, event))

    def cancel(self) -> None:
        for h in self.handles:
            self.owner.frontend.cancel(h)

    async def close(self) -> None:
        """Abort what still runs and forget every choice."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for h in self.handles:
            self.owner.live.pop(h.engine_id, None)


async def respond_n(
    owner: Any,
    handle: RequestHandle,
    req: CompletionRequest,
    shape: Shape,
    *,
    watch: Callable[[Callable[[], None]], asyncio.Task],
    shutdown: Failure,
) -> Response:
    """The response of a request with n > 1 choices or a list of prompts (see the module docstring).
    owner: the edge's Completions; watch(on_disconnect): the task that watches for the client going away."""
    choices = Choices(owner, handle, req)
    n = req.parsed.n
    shapes = [shape.for_choice(i, prompt=i // n) for i in range(len(choices.handles))]
    watcher = watch(choices.cancel)
    streaming = False
    try:
        first = await choices.queue.get()
        if isinstance(first[1], Failure):
            return failure_response(first[1])
        if req.stream:
            streaming = True
            return sse.EventStream(
                _stream(choices, first, req, shapes, owner, shutdown), watcher, choices.close
            )
        texts: list[list[str]] = [[] for _ in shapes]
        ids: list[list[int]] = [[] for _ in shapes]
        logprobs: list[list] = [[] for _ in shapes]
        prompts: list[Tokens | None] = [None] * len(shapes)
        done: list[Finished | None] = [None] * len(shapes)
        item = first
        while True:
            i, event = item
            if isinstance(event, Failure):
                return failure_response(event)
            if isinstance(event, Tokens):
                texts[i].append(event.text)
                ids[i] += event.token_ids
                logprobs[i] += event.logprobs or ()
                if event.prompt_logprobs is not None:
                    prompts[i] = event
            else:
                if owner.shutting_down and event.finish_reason == "cancelled":
                    return failure_response(shutdown)
                done[i] = event
                if all(d is not None for d in done):
                    break
            item = await choices.queue.get()
        bodies = [
            s.full("".join(t), d_ids, d, lp if req.logprobs else None, p)
            for s, t, d_ids, d, lp, p in zip(
                shapes, texts, ids, done, logprobs, prompts, strict=True
            )
        ]
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = combined_usage(done, n)
        return Response(orjson.dumps(body), media_type="application/json")
    finally:
        if not streaming:
            watcher.cancel()
            await choices.close()


async def _stream(
    choices: Choices,
    first: tuple[int, Any],
    req: CompletionRequest,
    shapes: list[Shape],
    owner: Any,
    shutdown: Failure,
) -> AsyncIterator[bytes]:
    """Every choice's chunks as they come (each with its index), then the usage, then [DONE]."""
    opened = [False] * len(shapes)
    done: list[Finished | None] = [None] * len(shapes)
    item = first
    while True:
        i, event = item
        out = b""
        if not opened[i]:
            opened[i] = True
            opening = shapes[i].first()
            out = sse.event(opening) if opening is not None else b""
        if isinstance(event, Failure):
            yield out + _error_event(event) + sse.DONE
            return
        if isinstance(event, Tokens):
            yield out + sse.event(shapes[i].delta(event.text, event.token_ids, event))
        elif owner.shutting_down and event.finish_reason == "cancelled":
            yield out + _error_event(shutdown) + sse.DONE
            return
        else:
            done[i] = event
            yield out + sse.event(shapes[i].last(event))
            if all(d is not None for d in done):
                if req.include_usage:
                    chunk = shapes[0].usage_chunk(event)
                    chunk["usage"] = combined_usage(done, req.parsed.n)
                    yield sse.event(chunk)
                yield sse.DONE
                return
        item = await choices.queue.get()


def _error_event(failure: Failure) -> bytes:
    return sse.event(error_body(STATUS[failure.code], failure.message, code=failure.reason))


def combined_usage(done: list[Finished], n: int) -> dict:
    """Each prompt counted once (it is computed once for its n choices), every choice's completion summed."""
    firsts = done[::n]  # the first choice of each prompt
    prompt = sum(d.prompt_tokens for d in firsts)
    completion = sum(d.completion_tokens for d in done)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)},
    }
    if done and done[0].accepted_prediction_tokens is not None:
        usage["completion_tokens_details"] = prediction_details(done)
    return usage
