"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeded generators.

Greedy rows take one argmax over the whole batch. Sampled rows are filtered together (one sort,
only when a row asks for top-k or top-p). Rows without a seed draw together in one batched
`multinomial` from the shared generator; a seeded row draws from its own torch.Generator, so its
tokens depend only on its seed and its own logits, never on what it was batched with. Only the
seeded rows loop in Python. The tokens come back to the host in one copy; on CUDA every per-step
tensor goes up from pinned memory, so nothing else in sampling waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from sloserve.sampling_params import SamplingParams


class Sampler:
    """Picks one token per logits row; keeps one generator per request until it finishes."""

    def __init__(self, device: torch.device | str, seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def __len__(self) -> int:
        return len(self._generators)

    def drop(self, req_ids: Sequence[str]) -> None:
        """Forget the generators of finished requests."""
        for req_id in req_ids:
            self._generators.pop(req_id, None)

    def _generator(self, req_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[req_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], req_ids: Sequence[str]
    ) -> list[int]:
        """One token id per row of logits[S, V]."""
        if logits.shape[0] == 0:
            return []
        # the step's one device-to-host copy
        return self.sample_on_device(logits, params, req_ids).tolist()

    def sample_on_device(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], req_ids: Sequence[str]
    ) -> torch.Tensor:
        """The token ids [S] on the logits' device, without waiting for it."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return tokens
        device = logits.device
        if len(sampled) == len(params):
            probs = filtered_probs(logits, params)
        else:
            rows = on_device(sampled, torch.int64, device)
            probs = filtered_probs(logits.index_select(0, rows), [params[i] for i in sampled])
        shared = [j for j, i in enumerate(sampled) if params[i].seed is None]
        if shared:  # one draw for every unseeded row
            picked = (
                probs
                if len(shared) == len(sampled)
                else probs.index_select(0, on_device(shared, torch.int64, device))
            )
            draws = torch.multinomial(picked, 1, generator=self._shared).squeeze(1)
            tokens.index_copy_(
                0, on_device([sampled[j] for j in shared], torch.int64, device), draws
            )
        for j, i in enumerate(sampled):
            if params[i].seed is not None:  # a copy on the device, not a read
                tokens[i] = torch.multinomial(
                    probs[j], 1, generator=self._generator(req_ids[i], params[i])
                )[0]
        return tokens

    def verify(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        req_id: str,
        drafts: Sequence[int],
        bonus: int,
    ) -> list[int]:
        """Rejection sampling of one sequence's drafts (Leviathan et al. 2023; Chen et al. 2023).

        `logits[i]` scores `drafts[i]`; `bonus` was sampled from the row after the last draft. A
        deterministic proposer's draft is a one-hot q, so draft d is kept with probability p(d)
        and, at the first rejection, the token is drawn from p with d removed (renormalised):
        each token then follows p exactly, as sampling one at a time would.
        """
        probs = filtered_probs(logits, [params] * len(drafts))
        gen = self._generator(req_id, params)
        ids = torch.tensor(drafts, dtype=torch.int64, device=probs.device)
        kept = probs.gather(1, ids[:, None])[:, 0]
        draws = torch.rand(len(drafts), generator=gen, device=probs.device)
        rejected = (draws >= kept).nonzero()
        if rejected.numel() == 0:
            return [*drafts, bonus]
        at = int(rejected[0, 0])
        rest = probs[at].clone()
        rest[drafts[at]] = 0.0
        token = int(torch.multinomial(rest, 1, generator=gen)[0])
        return [*drafts[:at], token]


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities [S, V] after temperature, top-k, top-p and min-p (float32; filtered entries are 0).

    min-p keeps the tokens at least min_p times as likely as the most likely one (transformers'
    MinPLogitsWarper); it compares ratios, so it gives the same set before or after top-k/top-p."""
    device = logits.device
    temps = on_device([p.temperature for p in params], torch.float32, device)
    scaled = logits.float() / temps[:, None]
    need_k = any(p.top_k for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = scaled.shape[-1]
        ranks = torch.arange(vocab, device=device)[None, :]
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            ks = on_device([p.top_k or vocab for p in params], torch.int64, device)
            remove |= ranks >= ks[:, None]
        if need_p:
            top_p = on_device([p.top_p for p in params], torch.float32, device)
            sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
            remove |= (before >= top_p[:, None]) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = on_device([p.min_p for p in params], torch.float32, device)
        floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor on `device`; on CUDA copied from pinned memory without a host sync
    (a copy from pageable memory waits for the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
