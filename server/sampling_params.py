"""Per-request generation settings and latency objectives (plain data, validated once)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sloserve.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. A seed makes a
    sampled request reproducible regardless of what it is batched with.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    grammar: str | None = None  # an llguidance grammar (sloserve.structured.grammar_for): tokens are masked to it

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError("grammar must be llguidance grammar text (see sloserve.structured.grammar_for)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stops_on(self, token: int, eos_token_ids: frozenset[int]) -> bool:
        """Does sampling `token` end the request (EOS unless ignore_eos, or a stop token id)?"""
        return (token in eos_token_ids and not self.ignore_eos) or token in self.stop_token_ids


@dataclass(slots=True)
class SLO:
    """Latency objectives in seconds, each optional: time to first token, per output token, end to end."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise InvalidRequestError(f"SLO {name} must be a finite number of seconds > 0, got {value!r}")
