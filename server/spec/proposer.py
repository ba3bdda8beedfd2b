"""Proposers: where a request's draft tokens come from, behind one interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sloserve.sched.request import Request
from sloserve.spec.ngram import lookup, nearest_lookup


class Proposer(Protocol):
    def propose(self, request: Request, k: int) -> list[int]:
        """At most `k` tokens the request is expected to produce next ([] for none)."""
        ...


@dataclass(slots=True, frozen=True)
class NgramProposer:
    """Prompt lookup over the request's prompt and output (vLLM's ngram method)."""

    min_n: int
    max_n: int

    def propose(self, request: Request, k: int) -> list[int]:
        """What followed the last earlier occurrence of the text's longest suffix n-gram."""
        return lookup(request.all_token_ids, k, self.min_n, self.max_n)


@dataclass(slots=True, frozen=True)
class PredictionProposer:
    """The client's predicted output (OpenAI Predicted Outputs), followed where the output follows it."""

    max_n: int

    def propose(self, request: Request, k: int) -> list[int]:
        """The prediction's continuation at the output's place in it; [] without a prediction."""
        if request.prediction is None:
            return []
        return nearest_lookup(request.output_token_ids, request.prediction, k, self.max_n)
