"""POST /v1/score: candidate continuations after one prompt, scored on its shared cached blocks.

Body ``{"model", "prompt": str | ids, "candidates": [str | ids, ...], "top_logprobs": int}``;
answer ``{"object": "score", "model", "data": [{"index", "tokens", "token_logprobs",
"sum_logprob", "top_logprobs"?}], "usage": {"prompt_tokens", "candidate_tokens",
"cached_tokens"}}``. Each candidate runs as one prompt-only request (sloserve.score); the first
to start computes the prompt and the others take its blocks from the prefix cache
(frontend/score.py runs them).
"""

from __future__ import annotations

from typing import Any

from sloserve.frontend.score import ScoreCall
from sloserve.http.errors import HttpError
from sloserve.score import ScoreOutput


def parse_score(body: Any, max_candidates: int, max_logprobs: int) -> ScoreCall:
    """The body's fields, each checked for its shape; HttpError 400 names the one that is wrong."""
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    prompt = body.get("prompt")
    if not (isinstance(prompt, str) or _is_ids(prompt)) or not prompt:
        raise HttpError(
            400, "prompt must be a non-empty string or list of token ids", param="prompt"
        )
    candidates = body.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        raise HttpError(
            400,
            "candidates must be a non-empty list of strings or token id lists",
            param="candidates",
        )
    if len(candidates) > max_candidates:
        raise HttpError(
            400,
            f"candidates has {len(candidates)} entries but at most {max_candidates} are scored "
            "in one call (--max-score-candidates); split the call",
            param="candidates",
        )
    for i, candidate in enumerate(candidates):
        if not (isinstance(candidate, str) or _is_ids(candidate)) or not candidate:
            raise HttpError(
                400,
                f"candidates[{i}] must be a non-empty string or list of token ids",
                param="candidates",
            )
    top = body.get("top_logprobs", 0)
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= max_logprobs:
        raise HttpError(
            400,
            f"top_logprobs must be an integer in [0, {max_logprobs}] (--max-logprobs), got {top!r}",
            param="top_logprobs",
        )
    return ScoreCall(prompt, candidates, top)


def score_response(
    model: str, prompt_tokens: int, outs: list[ScoreOutput], top_logprobs: int
) -> dict:
    """The /v1/score answer for scored candidates, in the order they were sent."""
    data = []
    for i, out in enumerate(outs):
        item: dict[str, Any] = {
            "index": i,
            "tokens": out.token_ids,
            "token_logprobs": out.token_logprobs,
            "sum_logprob": out.sum_logprob,
        }
        if top_logprobs:
            item["top_logprobs"] = [
                [{"token_id": t, "logprob": lp} for t, lp in top] for top in out.top_logprobs or []
            ]
        data.append(item)
    return {
        "object": "score",
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "candidate_tokens": sum(len(o.token_ids) for o in outs),
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
        },
    }


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )
