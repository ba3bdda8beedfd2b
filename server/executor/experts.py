"""The runner's side of the expert cache: each step's prediction and the periodic re-pinning.

Prediction: a sequence's next token tends to route, layer by layer, to experts near the ones its
last token chose, so each MoE layer's predicted experts for a step are the union of the experts
the step's sequences routed their last token to at that layer in their previous step (most
named first). It is known on the host before the step starts (the previous step's routing is
read once, after sampling has synchronised anyway), so predicting costs no device sync.

Residency: every `rebalance_every` steps the hottest experts by the routing EMA are pinned
(half the slots; the other half serve prefetches and misses, least recently used first).

With preloading off (or all experts resident) none of this runs: misses load on demand.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from sloserve.memory.expert_cache import ExpertStore

REBALANCE_EVERY = 16  # steps between re-pinnings (each reads the EMA once)


class ExpertPrefetcher:
    """Per-request routing history -> each step's per-layer prediction; periodic pinning of the hottest."""

    def __init__(
        self, store: ExpertStore, preload: bool, rebalance_every: int = REBALANCE_EVERY
    ) -> None:
        self.store = store
        self.enabled = preload and store.partial
        self.pin_count = store.slots_per_layer // 2 if self.enabled else 0
        self.rebalance_every = rebalance_every
        self._history: dict[str, list[list[int]]] = {}  # request id -> [layer][k] of its last token
        self._steps = 0

    def begin(self, req_ids: list[str], sampled_ids: list[str], rows: torch.Tensor | None) -> None:
        """A step over `req_ids` starts; `rows` [S] are the last-token rows of `sampled_ids`."""
        if not self.enabled:
            self.store.begin_step()
            return
        layers = len(self.store.layers)
        named: list[Counter[int]] = [Counter() for _ in range(layers)]
        for rid in req_ids:
            past = self._history.get(rid)
            if past is not None:
                for li in range(layers):
                    named[li].update(past[li])
        predicted = [sorted(c, key=lambda e, c=c: (-c[e], e)) for c in named]
        self.store.begin_step(predicted if any(predicted) else None, rows if sampled_ids else None)

    def end(self, sampled_ids: list[str]) -> None:
        """The step is done (sampled): keep each sampled sequence's routing; re-pin now and then."""
        captured = self.store.end_step()
        if not self.enabled:
            return
        if captured is not None:
            for rid, routing in zip(sampled_ids, captured, strict=True):
                self._history[rid] = routing
        self._steps += 1
        if self.pin_count and self._steps % self.rebalance_every == 0:
            self.store.pin_hottest(self.pin_count)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished requests: their history goes."""
        for rid in req_ids:
            self._history.pop(rid, None)

    def reset(self) -> None:
        """After synthetic steps (warm-up, step timing): no history, pins, EMA or counters from them."""
        self._history.clear()
        self._steps = 0
        if self.store.partial:
            self.store.pin_hottest(0)
        self.store.reset_stats(routing=True)
