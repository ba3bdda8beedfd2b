"""Log-probabilities from logits rows: the chosen token's and the top ones', in float32."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from sloserve.logprobs import Logprob


def gather_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], tops: Sequence[int]
) -> list[Logprob]:
    """One Logprob per row of logits[S, V]: log_softmax(row)[token_ids[i]] and its tops[i] best entries."""
    if logits.shape[0] == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    k = min(max(tops), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k:
        values, indices = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    return [
        Logprob(token, value, list(zip(top_ids[i][:n], top_values[i][:n], strict=True)))
        for i, (token, value, n) in enumerate(zip(token_ids, chosen, tops, strict=True))
    ]
