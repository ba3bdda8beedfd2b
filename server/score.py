"""Scoring candidate continuations after one shared prompt: the requests it runs and its results.

Each candidate runs as one prompt-only request over prompt + candidate whose prompt logprobs are
needed from the candidate's first token on (SamplingParams.prompt_logprobs_start), so the
scheduler reuses the prompt's cached blocks: the first candidate to start computes the prompt and
claims its blocks, the others wait for them and take them from the prefix cache
(docs/design/scoring.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.errors import InvalidRequestError
from sloserve.logprobs import Logprob
from sloserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ScoreOutput:
    """One candidate's score: its tokens, each one's log-probability after everything before it,
    their sum, and the `top_logprobs` most likely (id, logprob) at each position when asked."""

    token_ids: list[int]
    token_logprobs: list[float]
    sum_logprob: float
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # prompt + candidate tokens taken from the prefix cache instead of computed
    num_cached_tokens: int = 0
    error: str | None = None


def score_params(prompt_len: int, top_logprobs: int = 0) -> SamplingParams:
    """Sampling for one candidate's request: score prompt + candidate from the candidate on, sample nothing."""
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or top_logprobs < 0:
        raise InvalidRequestError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
    return SamplingParams(
        max_tokens=0, prompt_logprobs=top_logprobs, prompt_logprobs_start=prompt_len
    )


def check_candidates(
    prompt: list[int], candidates: list[list[int]], max_model_len: int, max_candidates: int
) -> None:
    """Raise InvalidRequestError naming the field when the prompt or a candidate cannot be scored."""
    if not prompt:
        raise InvalidRequestError(
            "prompt is empty: the first candidate token needs a token before it"
        )
    if not candidates:
        raise InvalidRequestError("candidates is empty: send at least one continuation to score")
    if len(candidates) > max_candidates:
        raise InvalidRequestError(
            f"candidates has {len(candidates)} entries but at most {max_candidates} are scored "
            "in one call (--max-score-candidates); split the call"
        )
    for i, candidate in enumerate(candidates):
        if not candidate:
            raise InvalidRequestError(f"candidates[{i}] is empty: send at least one token")
        total = len(prompt) + len(candidate)
        if total >= max_model_len:
            raise InvalidRequestError(
                f"candidates[{i}]: prompt + candidate is {total} tokens but the model takes at "
                f"most {max_model_len - 1}; shorten the prompt or the candidate"
            )


def score_of(
    candidate: list[int],
    prompt_logprobs: list[Logprob | None] | None,
    top_logprobs: int,
    num_cached_tokens: int = 0,
    error: str | None = None,
) -> ScoreOutput:
    """A candidate's ScoreOutput from its request's prompt logprobs (the last len(candidate))."""
    if error is not None or prompt_logprobs is None:
        return ScoreOutput(list(candidate), [], float("nan"), None, num_cached_tokens, error)
    entries = prompt_logprobs[len(prompt_logprobs) - len(candidate) :]
    if any(e is None for e in entries):
        raise RuntimeError("a scored candidate position came back without its logprob")
    values = [e.logprob for e in entries]
    tops = [list(e.top) for e in entries] if top_logprobs else None
    return ScoreOutput(list(candidate), values, sum(values), tops, num_cached_tokens)
