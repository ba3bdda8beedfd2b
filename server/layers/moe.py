"""Mixture-of-experts dispatch: route every token, group (token, expert) pairs by expert, combine.

One step's MoE layer, for T tokens choosing k of E experts::

    route      softmax(router_logits) in float32 -> top-k -> renormalise   weights[T,k], ids[T,k]
    group      pairs (t, j) sorted by ids[t, j] (stable)                  rows[T*k, H] = hidden[t]
    compute    each active expert once on its contiguous slice of rows    SiLU(x Wg) * (x Wu) Wd
    combine    un-sort, scale by the routing weight, add a token's k
               contributions in ascending expert order (a fixed order, no atomics)

The ascending-expert sum is the order transformers' per-expert loop accumulates in, so the
result matches it to rounding of the per-expert matmuls.

Two ways to compute: with grouped GEMMs (`store.grouped`, on CUDA when torch has them) every
active expert runs in one `torch._grouped_mm` per projection, its slice bounds a device cumsum:
with every expert resident the layer makes no host sync at all. Otherwise (and with partial
residency, which must learn the active experts on the host to serve misses) the counts are read
back once per layer and each expert runs one matmul on its slice. Both give the same rows.
int8 experts (`--quantization int8`, a CPU) run the per-expert path through Int8Linear's products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sloserve.layers.quant import Int8Linear
from sloserve.memory.expert_cache import ExpertStore, MoeWorkspace

__all__ = ["ExpertStore", "moe_forward", "route"]


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] float32 and expert ids [T, k] int64 (softmax in float32, then top-k)."""
    if router_logits.dim() != 2:
        raise ValueError(
            f"router logits must be [tokens, experts], got shape {tuple(router_logits.shape)}"
        )
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
        raise ValueError(
            f"hidden size {hidden_size} does not match the experts' {store.hidden_size}"
        )
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    store.before_layer(layer)  # the next MoE layer's predicted experts start copying now
    weights, ids = route(router_logits, top_k, renormalize)
    # Each token's k choices in ascending expert order: the order its contributions are added in.
    ids, perm = ids.sort(dim=1)
    weights = weights.gather(1, perm)
    flat_ids = ids.reshape(-1)  # [N = T*k]
    order = torch.argsort(flat_ids, stable=True)  # pair positions grouped by expert
    counts = _count(flat_ids, store.num_experts)  # [E] pairs per expert
    store.record_routing(layer, ids, counts)
    ws = store.reserve_workspace(flat_ids.numel())
    try:
        contrib = None  # [N, H], (t, j) order
        counts_list = None
        if store.grouped:
            # partial: the one host sync
            counts_list = None if not store.partial else counts.tolist()
            contrib = _grouped_gemm_experts(
                hidden, flat_ids, order, counts, counts_list, store, layer, top_k, ws
            )
        if contrib is None:
            contrib = _sliced_experts(hidden, order, counts, counts_list, store, layer, top_k, ws)
        # Scale by the routing weight (in float32, like transformers), in place.
        contrib = contrib.view(num_tokens, top_k, hidden_size).mul_(weights.unsqueeze(-1))
        out = contrib[:, 0].clone()
        for j in range(1, top_k):
            out += contrib[:, j]
    finally:
        store.release_workspace()
    return out


def _count(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Occurrences of each of 0..n-1 in `ids` (int64 [n]); unlike bincount, no host sync on CUDA."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(
        0, ids, torch.ones_like(ids)
    )


def _grouped_gemm_experts(
    hidden: torch.Tensor,
    flat_ids: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    counts_list: list[int] | None,
    store: ExpertStore,
    layer: int,
    top_k: int,
    ws: MoeWorkspace | None,
) -> torch.Tensor | None:
    """Every active expert in two grouped GEMMs over stacked resident weights; None: not possible here.

    All resident: offsets from a device cumsum, no host sync. Partial residency: the active experts
    (`counts_list`, read back once) are held resident together (None when they do not all fit)
    and the pairs re-grouped by slot, so the GEMMs run over the slot stack.
    """
    held = active = None
    if counts_list is not None:
        active = [e for e, c in enumerate(counts_list) if c]
        held = store.hold(layer, active)
        if held is None:
            return None
        w13, w2, slot_of = held
        slot_ids = torch.tensor(slot_of, device=flat_ids.device).index_select(0, flat_ids)
        order = torch.argsort(slot_ids, stable=True)  # pair positions grouped by slot
        counts = _count(slot_ids, w13.shape[0])
    else:
        w13, w2 = store.stacked(layer, counts)
    try:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        # [N, H]
        rows = torch.index_select(
            hidden, 0, order // top_k, out=ws.rows if ws is not None else None
        )
        # [N, I] each
        gate, up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        act = torch.mul(F.silu(gate, inplace=True), up, out=ws.act if ws is not None else None)
        out_sorted = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [N, H], grouped order
        # The gathered inputs are dead: their rows take the outputs back in (t, j) order.
        return rows.index_copy_(0, order, out_sorted)
    finally:
        if held is not None:
            store.release(layer, active, held[2])


def _sliced_experts(
    hidden: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    counts_list: list[int] | None,
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
    if counts_list is None:
        counts_list = counts.tolist()  # the one host sync: slice bounds per expert
    starts = [0] * store.num_experts
    total = 0
    for e, c in enumerate(counts_list):
        starts[e] = total
        total += c
    active = [e for e, c in enumerate(counts_list) if c]
    for e, w13, w2 in store.experts(layer, active):
        lo, hi = starts[e], starts[e] + counts_list[e]
        if isinstance(w13, Int8Linear):
            # int8 experts: Int8Linear's products (W8A8 or W8A16 by the expert's row count)
            gate, up = w13(rows[lo:hi]).chunk(2, dim=-1)
            out_sorted[lo:hi] = w2(F.silu(gate, inplace=True).mul_(up))
            continue
        if ws is None:
            gate_up = torch.mm(rows[lo:hi], w13.t())
            act = torch.empty(
                hi - lo, store.intermediate_size, dtype=rows.dtype, device=rows.device
            )
        else:
            gate_up = torch.mm(rows[lo:hi], w13.t(), out=ws.gate_up[lo:hi])
            act = ws.act[lo:hi]
        gate, up = gate_up.chunk(2, dim=-1)
        torch.mul(F.silu(gate, inplace=True), up, out=act)
        torch.mm(act, w2.t(), out=out_sorted[lo:hi])
    # The gathered inputs are dead: their rows take the outputs back in (t, j) order.
    return rows.index_copy_(0, order, out_sorted)
