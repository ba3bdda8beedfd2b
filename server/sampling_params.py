"""Per-request generation settings and latency objectives (plain data, validated once)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sloserve.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0, top_p 1.0 and min_p 0 disable those filters. A seed makes
    a sampled request reproducible regardless of what it is batched with. Penalties, logit_bias and
    min_tokens change the logits before sampling (layers/penalties.py); logprobs (top entries per
    output token, 0: the sampled token's only) and prompt_logprobs (per prompt token) are the
    model's raw log-softmax, before any of them (layers/logprobs.py).
    """

    max_tokens: int = 64  # 0 (with prompt_logprobs): compute and score the prompt, sample nothing
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # EOS and stop token ids are masked, and stop strings unchecked, until this many
    min_tokens: int = 0
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    # transformers': logits of prompt and output tokens / (or x) this
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens whose probability is under min_p x the most likely one's
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # top log-probabilities per output token (0: the sampled token's only)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none)
    # prompt logprobs are needed from this position on (earlier ones are None): the prompt's cached
    # blocks before it are reused (scoring candidates after a shared prompt)
    prompt_logprobs_start: int = 0
    # an llguidance grammar (sloserve.structured.grammar_for): tokens are masked to it
    grammar: str | None = None
    # a loaded LoRA adapter's name (None: the base model); part of the prefix-cache key
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidRequestError(
                "max_tokens must be an integer >= 1, got 0 (0, which only scores the "
                "prompt, needs prompt_logprobs)"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
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
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0 (1 disables it), "
                f"got {self.repetition_penalty!r}"
            )
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidRequestError(f"{name} must be an integer >= 0, got {value!r}")
        start = self.prompt_logprobs_start
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise InvalidRequestError(
                f"prompt_logprobs_start must be an integer >= 0, got {start!r}"
            )
        if start and self.prompt_logprobs is None:
            raise InvalidRequestError(
                "prompt_logprobs_start needs prompt_logprobs (it says from where they are needed)"
            )
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError(
                "grammar must be llguidance grammar text (see sloserve.structured.grammar_for)"
            )
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InvalidRequestError(
                f"adapter must be a loaded LoRA adapter's name, got {self.adapter!r}"
            )

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: the request computes its prompt (for its prompt logprobs) and samples nothing."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Do the logits depend on the tokens so far (a presence, frequency or repetition penalty)?"""
        return (
            bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Does anything change the logits before sampling (penalties, logit_bias, min_tokens)?"""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def needs_context(self) -> bool:
        """Must each step carry the request's tokens so far (penalties, prompt logprobs)?"""
        return self.penalized or self.prompt_logprobs is not None

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
                raise InvalidRequestError(
                    f"SLO {name} must be a finite number of seconds > 0, got {value!r}"
                )
