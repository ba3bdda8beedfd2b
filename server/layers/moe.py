"""Mixture-of-experts dispatch: route every token, group (token, expert) pairs by expert, combine.

One step's MoE layer, for T tokens choosing k of E experts::

    route      softmax(router_logits) in float32 -> top-k -> renormalise   weights[T,k], ids[T,k]
    group      pairs (t, j) sorted by ids[t, j] (stable)                  rows[T*k, H] = hidden[t]
    compute    each active expert once on its contiguous slice of rows    SiLU(x Wg) * (x Wu) Wd
    combine    un-sort, scale by the routing weight, add a token's k
               contributions in ascending expert order (a fixed order, no atomics)

The ascending-expert sum is the order transformers' per-expert loop accumulates in, so the
result matches it to rounding of the per-expert matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sloserve.memory.expert_cache import ExpertStore, MoeWorkspace

__all__ = ["ExpertStore", "moe_forward", "route"]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] float32 and expert ids [T, k] int64 (softmax in float32, then top-k)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_forward(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    store: ExpertStore,
    layer: int,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """Routed-experts output [T, H] of one MoE layer (shared experts are the model's business)."""
    num_tokens, hidden_size = hidden.shape
    if router_logits.shape != (num_tokens, store.num_experts):
        raise ValueError(
            f"router logits must be [{num_tokens}, {store.num_experts}] for {num_tokens} tokens, "
            f"got {tuple(router_logits.shape)}"
        )
    if hidden_size != store.hidden_size:
        raise ValueError(f"hidden size {hidden_size} does not match the experts' {store.hidden_size}")
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    weights, ids = route(router_logits, top_k, renormalize)
    # Each token's k choices in ascending expert order: the order its contributions are added in.
    ids, perm = ids.sort(dim=1)
    weights = weights.gather(1, perm)
    flat_ids = ids.reshape(-1)  # [N = T*k]
    order = torch.argsort(flat_ids, stable=True)  # pair positions grouped by expert
    counts = torch.bincount(flat_ids, minlength=store.num_experts)
    store.record_counts(layer, counts)
    ws = store.reserve_workspace(flat_ids.numel())
    try:
        contrib = _grouped_experts(hidden, order, counts, store, layer, top_k, ws)  # [N, H], (t, j) order
        # Scale by the routing weight (in float32, like transformers), in place.
        contrib = contrib.view(num_tokens, top_k, hidden_size).mul_(weights.unsqueeze(-1))
        out = contrib[:, 0].clone()
        for j in range(1, top_k):
            out += contrib[:, j]
    finally:
        store.release_workspace()
    return out


def _grouped_experts(
    hidden: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    store: ExpertStore,
    layer: int,
    top_k: int,
    ws: MoeWorkspace | None,
) -> torch.Tensor:
    """Each active expert once on its contiguous slice; returns the outputs back in (t, j) order.

    With a workspace every intermediate is written into its carved rows (out= / in place);
    without one they are ordinary temporaries. Both compute the same values.
    """
    if ws is None:
        rows = hidden.index_select(0, order // top_k)  # [N, H], expert-major
        out_sorted = torch.empty_like(rows)
    else:
        rows = torch.index_select(hidden, 0, order // top_k, out=ws.rows)
        out_sorted = ws.out
    counts_list = counts.tolist()  # the one host sync: slice bounds per expert
    starts = [0] * store.num_experts
    total = 0
    for e, c in enumerate(counts_list):
        starts[e] = total
        total += c
    active = [e for e, c in enumerate(counts_list) if c]
    for e, w13, w2 in store.experts(layer, active):
        lo, hi = starts[e], starts[e] + counts_list[e]
        if ws is None:
            gate_up = torch.mm(rows[lo:hi], w13.t())
            act = torch.empty(hi - lo, store.intermediate_size, dtype=rows.dtype, device=rows.device)
        else:
            gate_up = torch.mm(rows[lo:hi], w13.t(), out=ws.gate_up[lo:hi])
            act = ws.act[lo:hi]
        gate, up = gate_up.chunk(2, dim=-1)
        torch.mul(F.silu(gate, inplace=True), up, out=act)
        torch.mm(act, w2.t(), out=out_sorted[lo:hi])
    # The gathered inputs are dead: their rows take the outputs back in (t, j) order.
    return rows.index_copy_(0, order, out_sorted)
