"""The Score rpc's messages in plain data and back (the call itself runs in frontend/score.py)."""

from __future__ import annotations

from sloserve.errors import InvalidRequestError
from sloserve.frontend.score import ScoreCall
from sloserve.pb import serving_pb2 as pb
from sloserve.score import ScoreOutput


def score_from_pb(req: pb.ScoreRequest, max_logprobs: int) -> ScoreCall:
    """A ScoreRequest as a ScoreCall; InvalidRequestError names a field that cannot be converted."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt: set text or token_ids")
    prompt: str | list[int] = list(req.token_ids.ids) if kind == "token_ids" else req.text
    candidates: list[str | list[int]] = []
    for i, candidate in enumerate(req.candidates):
        which = candidate.WhichOneof("kind")
        if which is None:
            raise InvalidRequestError(f"candidates[{i}]: set text or token_ids")
        candidates.append(list(candidate.token_ids.ids) if which == "token_ids" else candidate.text)
    if req.top_logprobs > max_logprobs:
        raise InvalidRequestError(
            f"top_logprobs is {req.top_logprobs} but at most {max_logprobs} are returned "
            "(--max-logprobs)"
        )
    return ScoreCall(prompt, candidates, req.top_logprobs)


def score_pb(prompt_tokens: int, outs: list[ScoreOutput]) -> pb.ScoreResponse:
    """The ScoreResponse for scored candidates, in the order they were sent."""
    return pb.ScoreResponse(
        candidates=[
            pb.ScoredCandidate(
                token_ids=out.token_ids,
                token_logprobs=out.token_logprobs,
                sum_logprob=out.sum_logprob,
                top_logprobs=[
                    pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
                    for top in out.top_logprobs or []
                ],
            )
            for out in outs
        ],
        prompt_tokens=prompt_tokens,
        candidate_tokens=sum(len(out.token_ids) for out in outs),
        cached_tokens=sum(out.num_cached_tokens for out in outs),
    )
