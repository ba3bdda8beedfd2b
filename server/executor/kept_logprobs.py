"""The logprobs a step computed for the requests that asked, kept until its result carries them."""

from __future__ import annotations

import torch
from sloserve.layers.logprobs import gather_logprobs
from sloserve.logprobs import Logprob
from sloserve.sched.output import ScheduledSequence, StepResult


class KeptLogprobs:
    """Per request: its sampled tokens' logprobs in order, and its prompt tokens' as runs."""

    def __init__(self) -> None:
        self._sampled: dict[str, list[Logprob]] = {}
        self._prompt: dict[str, list[tuple[int, list[Logprob]]]] = {}

    def keep_sampled(
        self, req_ids: list[str], raw: torch.Tensor, tokens: list[int], tops: list[int]
    ) -> None:
        """One entry per row of raw (the unprocessed logits of the requests that asked)."""
        for req_id, entry in zip(req_ids, gather_logprobs(raw, tokens, tops), strict=True):
            self._sampled.setdefault(req_id, []).append(entry)

    def keep_prompt(
        self,
        seqs: list[ScheduledSequence],
        prompt_rows: list[tuple[int, range]],
        logits: torch.Tensor,
    ) -> None:
        """Each prompt row's logprob of the prompt token after it, kept as (first position, entries)."""
        targets, tops = [], []
        for i, positions in prompt_rows:
            seq = seqs[i]
            targets += seq.context[positions.start + 1 : positions.stop + 1]
            tops += [seq.sampling.prompt_logprobs] * len(positions)
        found = iter(gather_logprobs(logits, targets, tops))
        for i, positions in prompt_rows:
            entries = [next(found) for _ in positions]
            self._prompt.setdefault(seqs[i].req_id, []).append((positions.start + 1, entries))

    def result(self, tokens: list[list[int]]) -> StepResult:
        """The step's result: its `tokens`, and what was kept since the last call (then forgotten)."""
        result = StepResult(tokens, self._sampled, self._prompt)
        self._sampled, self._prompt = {}, {}
        return result

    def clear(self) -> None:
        """Forget what was kept (a failed step's)."""
        if self._sampled or self._prompt:
            self._sampled, self._prompt = {}, {}
