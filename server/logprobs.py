"""Log-probabilities of one position as plain data: they cross from the executor to the HTTP edge."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """The chosen token's log-probability at one position and the `top` most likely (id, logprob)
    there, most likely first; the model's raw log-softmax in float32 (before temperature,
    penalties and logit_bias, as vLLM's default)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
