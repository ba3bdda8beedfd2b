"""NewRequest: the one value a request is from the edge to the scheduler (validated once, here)."""

from __future__ import annotations

import msgspec
from sloserve.errors import InvalidRequestError
from sloserve.sampling_params import SLO, SamplingParams

PRIORITY_MIN, PRIORITY_END = -(2**63), 2**63  # msgpack carries a 64-bit integer


class NewRequest(msgspec.Struct, array_like=True):
    """A request as the engine receives it: what to run, how to sample it, and by when.

    It is also the engine process's wire message (engine/wire.py): an array-like struct, so a
    field added later goes last with a default, and a sender that predates it still decodes.
    Its shape is checked here, on construction and on decode; what needs the engine's knowledge
    (vocabulary, context length, a duplicate id, admission) is checked where that lives.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    slo: SLO | None = None
    # time.monotonic() at arrival (CLOCK_MONOTONIC is shared across processes); None: the engine
    # stamps it when the request reaches it
    arrival_time: float | None = None
    priority: int = 0  # lower runs first under the priority policy
    # the client's predicted output tokens (OpenAI Predicted Outputs): drafts to verify
    prediction: list[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequestError(
                f"params must be SamplingParams, got {type(self.params).__name__}"
            )
        if not isinstance(self.token_ids, list | tuple) or not all(
            isinstance(t, int) for t in self.token_ids
        ):
            raise InvalidRequestError("the prompt must be a list of integer token ids")
        if not self.token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        if self.params.prompt_logprobs_start >= len(self.token_ids):
            raise InvalidRequestError(
                f"prompt_logprobs_start is {self.params.prompt_logprobs_start} but the prompt has "
                f"{len(self.token_ids)} tokens: it must name a prompt position"
            )
        if isinstance(self.token_ids, tuple):
            self.token_ids = list(self.token_ids)
        if self.prediction is not None:
            if not isinstance(self.prediction, list | tuple) or not all(
                isinstance(t, int) and t >= 0 for t in self.prediction
            ):
                raise InvalidRequestError("the prediction must be a list of token ids >= 0")
            if len(self.prediction) > self.params.max_tokens:
                raise InvalidRequestError(
                    f"the prediction has {len(self.prediction)} tokens, more than max_tokens "
                    f"({self.params.max_tokens}): raise max_tokens or shorten the prediction"
                )
            self.prediction = list(self.prediction) or None
        priority = self.priority
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not PRIORITY_MIN <= priority < PRIORITY_END
        ):
            raise InvalidRequestError(
                f"priority must be an integer in the 64-bit range (msgpack), got {priority!r}"
            )
