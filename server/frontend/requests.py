"""Plain data in and out of the front end: a parsed request, and the events of one request."""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.frontend.failures import Failure
from sloserve.logprobs import Logprob
from sloserve.sampling_params import SLO, SamplingParams

DEFAULT_MAX_TOKENS = 64  # when a request does not say (capped at the server's max_tokens limit)


@dataclass(slots=True)
class ParsedRequest:
    """A request as a transport read it: not yet checked against the server's limits."""

    prompt: str | list[int]
    params: SamplingParams
    slo: SLO | None = None
    # NOTE: lower runs first under the `priority` policy; other policies ignore it
    priority: int = 0
    add_special_tokens: bool = True  # False for a chat prompt: its template already wrote them
    n: int = 1  # choices wanted: the edge runs n requests over the same prompt (its KV shared by the prefix cache)
    # OpenAI Predicted Outputs: the output expected (text or token ids), verified as drafts
    prediction: str | list[int] | None = None


@dataclass(slots=True, frozen=True)
class Tokens:
    """New tokens of one request; `time_s` counts from its arrival stamp."""

    token_ids: list[int]
    text: str
    time_s: float
    logprobs: list[Logprob] | None = None  # one per token id, when the request asked
    prompt_logprobs: list[Logprob | None] | None = None  # once, with the first tokens, when asked
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the tokens they score


@dataclass(slots=True, frozen=True)
class Finished:
    """A request ran to a finish reason ('stop', 'length', 'cancelled'); times count from arrival.

    `ttft_s` and `e2e_s` are the time_s of its first and last Tokens (so no chunk is ever later
    than e2e_s); `queue_s` is when the engine first scheduled it. None: that never happened.
    """

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float
    # with a prediction only: its tokens accepted into the output and rejected (OpenAI's usage)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


Event = Tokens | Finished | Failure  # Finished or Failure is the last event of a request
