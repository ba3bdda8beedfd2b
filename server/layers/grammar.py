"""Grammar-constrained sampling: one llguidance matcher per request, a token bitmask per step.

The step's order, per sampled row that carries `SamplingParams.grammar`:

    begin(rows)   before the forward: the matchers fill the bitmask (on a CPU also unpacked to one
                  flag per token); on a GPU in a worker thread (llguidance releases the GIL), so
                  the mask is computed while the model runs
    apply(logits) after the forward: wait for the mask, set every token it forbids to -inf
                  (before argmax and before any filter, so greedy and sampled rows obey it)
    accept(ids)   after sampling: each matcher consumes its row's token

A matcher lives from its request's first sampled token until `drop` (finished or aborted); its
grammar is compiled once per distinct grammar text and kept in a bounded LRU cache, and each
request starts from a copy of the compiled matcher. A matcher that has stopped (its grammar
ended) allows only EOS; one that broke, or allows nothing at all, leaves its row unmasked: what a
run of steps samples after a stop is never used.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from sloserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingMask:
    """One step's grammar rows: their matchers, their indices among the sampled rows, the mask being filled."""

    matchers: list[llguidance.LLMatcher]
    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words] int32 on the host
    filled: Future | None


class GrammarMasks:
    """The engine's matchers, keyed by request id, and the compiled grammars they start from."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
        cache_size: int = 64,
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer_json = tokenizer_json
        self._eos = list(eos_token_ids)
        # built on first use (~1 s for a large vocabulary)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._words = (vocab_size + 31) // 32
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._host: torch.Tensor | None = None
        # else the packed words go to the device and unpack there
        self.unpack_on_host = device.type == "cpu"
        # NOTE: on a GPU the host is idle during the forward, so a worker thread fills the mask then; a
        # CPU forward already runs on every core (the fused decode team spins), and handing the
        # thread the GIL cost more than the fill itself there (benchmarks/structured.py): inline.
        self.overlap = device.type != "cpu"

    def __len__(self) -> int:
        """Live matchers (one per running request with a grammar)."""
        return len(self._matchers)

    @property
    def compiled(self) -> int:
        return len(self._compiled)

    def drop(self, req_ids: Sequence[str]) -> None:
        """Forget the matchers of finished requests."""
        for req_id in req_ids:
            self._matchers.pop(req_id, None)

    def begin(self, params: Sequence[SamplingParams], req_ids: Sequence[str]) -> PendingMask | None:
        """Start filling the mask of the sampled rows that have a grammar (None: no row has one)."""
        rows = [i for i, p in enumerate(params) if p.grammar is not None]
        if not rows:
            return None
        matchers = [self._matcher(req_ids[i], params[i].grammar) for i in rows]
        # reused: a step syncs before the next fills it
        if self._host is None or self._host.shape[0] < len(rows):
            self._host = torch.empty(
                (max(len(rows), 16), self._words),
                dtype=torch.int32,
                pin_memory=self.device.type == "cuda",
            )
        bitmask = self._host[: len(rows)]
        bitmask.fill_(-1)
        # a stopped one allows EOS alone
        live = [(m, j) for j, m in enumerate(matchers) if not m.is_error()]
        filled = None
        if live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            if self.overlap:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
                filled = self._thread.submit(self._fill, live, bitmask)
            else:
                filled = Future()
                filled.set_result(self._fill(live, bitmask))
        return PendingMask(matchers, rows, bitmask, filled)

    def _fill(
        self, live: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor
    ) -> torch.Tensor | None:
        """The worker thread's part: the matchers' bitmask, then (on a CPU) the blocked tokens unpacked."""
        self._executor.unsafe_compute_mask_ptr(
            live, bitmask.data_ptr(), self._words * 4, bitmask.shape[0]
        )
        # nothing allowed (no EOS id to end on): leave the row free
        dead = ~(bitmask != 0).any(dim=1)
        if dead.any():
            bitmask[dead] = -1
        if not self.unpack_on_host:
            return None  # unpacked on the device, after one copy of the packed words
        # NOTE: numpy's unpackbits is one C pass, faster than shifts in torch; bit j of a
        # little-endian int32 word w is token 32w + j. Inverted first: a set bit is a blocked token.
        blocked = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(blocked).view(torch.bool)

    @torch.inference_mode()  # the forward's logits may be inference tensors: updated in place only inside it
    def apply(self, pending: PendingMask, logits: torch.Tensor) -> None:
        """Set the logits[S, V] of tokens the grammar rows may not take to -inf, in place."""
        if pending.filled is None:
            return  # no live matcher: every row is free
        blocked = pending.filled.result()
        vocab = logits.shape[-1]
        if blocked is None:
            bits = pending.bitmask.to(self.device, non_blocking=True)
            blocked = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(len(pending.rows), -1) == 0
        blocked = blocked[:, :vocab]
        if len(pending.rows) == logits.shape[0]:
            logits.masked_fill_(blocked, float("-inf"))
            return
        rows = torch.tensor(pending.rows, device=logits.device)
        logits.index_copy_(
            0, rows, logits.index_select(0, rows).masked_fill_(blocked, float("-inf"))
        )

    def accept(self, pending: PendingMask, tokens: Sequence[int]) -> None:
        """Advance each grammar row's matcher by the token its row sampled."""
        for matcher, row in zip(pending.matchers, pending.rows, strict=True):
            if matcher.is_stopped() or matcher.is_error():
                continue
            if not matcher.consume_token(tokens[row]):
                log.warning(
                    "a grammar matcher refused sampled token %d: %s",
                    tokens[row],
                    matcher.get_error(),
                )

    def _matcher(self, req_id: str, grammar: str) -> llguidance.LLMatcher:
        matcher = self._matchers.get(req_id)
        if matcher is None:
            matcher = self._matchers[req_id] = self._compile(grammar).deep_copy()
        return matcher

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        compiled = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        # the front ends check every grammar: only a direct caller gets here
        if compiled.is_error():
            log.error(
                "a request's grammar does not compile here, so it runs unconstrained: %s",
                compiled.get_error()[:400],
            )
        self._compiled[grammar] = compiled
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return compiled
