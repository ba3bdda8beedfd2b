"""Logits processing before sampling: penalties, logit_bias and min_tokens (rows that ask only).

Per row, in this order (a row that asks for none is left as the model gave it):
1. repetition_penalty over every token of the prompt and the output so far, as transformers'
   RepetitionPenaltyLogitsProcessor: a positive logit is divided by it, a negative one multiplied;
2. presence and frequency penalties over the output's tokens, OpenAI's documented formula:
   logit - count * frequency_penalty - (count > 0) * presence_penalty;
3. logit_bias added to its tokens' logits;
4. min_tokens: while fewer have been generated, EOS (unless ignore_eos) and stop_token_ids get -inf,
   as vLLM does.
Temperature, top-k, top-p and min-p come after, in the sampler (layers/sampler.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from sloserve.sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[list[int] | None],
    num_generated: Sequence[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """A float32 copy of logits[S, V] with each row's processing applied (see the module docstring).

    contexts[i]: row i's tokens so far, prompt then output (needed only by a penalized row);
    num_generated[i]: how many of them are output.
    """
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i, p in enumerate(params):
        if not p.processes_logits:
            continue
        row = out[i]
        if p.penalized:
            context = contexts[i]
            if context is None:
                raise ValueError(
                    "a penalized sequence must carry its tokens so far (ScheduledSequence.context)"
                )
            tokens = torch.tensor(context, dtype=torch.int64, device=out.device)
            if p.repetition_penalty != 1.0:
                seen = tokens.unique()
                values = row[seen]
                row[seen] = torch.where(
                    values < 0, values * p.repetition_penalty, values / p.repetition_penalty
                )
            if p.presence_penalty or p.frequency_penalty:
                output = tokens[len(context) - num_generated[i] :]
                counts = torch.bincount(output, minlength=vocab)[:vocab].to(out.dtype)
                row -= (
                    counts * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty
                )
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=out.device)
            row[ids] += torch.tensor(
                list(p.logit_bias.values()), dtype=out.dtype, device=out.device
            )
        if num_generated[i] < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned = [t for t in banned if t < vocab]
            if banned:
                row[torch.tensor(banned, dtype=torch.int64, device=out.device)] = float("-inf")
    return out
