"""How many routed experts of each MoE layer stay resident on the device: set, or chosen from the budget.

The device budget (``memory_budget_bytes``) holds experts, the KV pool and the step workspaces;
the dense weights are already loaded when it is measured. Three ways to decide::

    expert_slots_per_layer N     N experts per layer resident (all when N >= the checkpoint's)
    expert_memory_bytes B        as many slots per layer as B holds
    automatic (neither)          all resident when all experts + the minimum KV pool + workspaces
                                 fit the budget; otherwise the most slots per layer that leave the
                                 minimum KV pool room (logged with the reason)

The minimum KV pool is one ``max_model_len`` sequence plus the null page (or the KV pool size
set explicitly). A budget that cannot hold one slot per layer plus that minimum is a ValueError
at start-up, naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.config import CacheConfig
from sloserve.models.spec import ModelSpec


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass(slots=True, frozen=True)
class Residency:
    slots: int | None  # resident experts per MoE layer when partial; None: all resident
    expert_bytes: int  # one routed expert, w13 + w2
    device_bytes: int  # device bytes the experts take (all of them, or the slots)
    reason: str  # one line: what was chosen and why

    @property
    def partial(self) -> bool:
        return self.slots is not None


def expert_bytes(spec: ModelSpec, itemsize: int, int8: bool = False) -> int:
    """Bytes of one routed expert: gate and up [2I, H] plus down [H, I] (`int8`: a byte each, and
    a float32 scale per row, as ExpertStore holds them under --quantization int8)."""
    i, h = spec.moe_intermediate_size, spec.hidden_size
    return 3 * i * h + (2 * i + h) * 4 if int8 else 3 * i * h * itemsize


def slot_pool_bytes(slot_bytes: int, arena: int, carves: int = 2) -> int:
    """Pool bytes the expert slot carves take (two; int8 four: the scales' too), with what arena
    alignment may skip before them."""
    return slot_bytes + min(slot_bytes, carves * arena)


def choose_residency(
    cc: CacheConfig,
    spec: ModelSpec,
    itemsize: int,
    budget: int | None,
    min_kv: int,
    workspaces: int,
    arena: int,
    int8: bool = False,
) -> Residency:
    """The residency of `spec`'s experts under `budget` (None: unbounded) beside `min_kv` + `workspaces`.

    All-resident experts keep tensors of their own; partial residency carves its slots from the
    pool, so their arena alignment counts as well (slot_pool_bytes).
    """
    num_experts, layers = spec.num_experts, len(spec.moe_layers)
    one = expert_bytes(spec, itemsize, int8)
    carves = 4 if int8 else 2
    per_slot = layers * one  # one slot in every MoE layer
    everything = num_experts * per_slot
    rest = min_kv + workspaces
    if cc.expert_slots_per_layer is not None:
        slots, how = min(cc.expert_slots_per_layer, num_experts), "expert_slots_per_layer"
    elif cc.expert_memory_bytes is not None:
        slots, how = min(cc.expert_memory_bytes // per_slot, num_experts), "expert_memory_bytes"
        if slots < 1:
            raise ValueError(
                f"expert memory {mib(cc.expert_memory_bytes)} holds no expert slot: one slot in each of the "
                f"{layers} MoE layers takes {mib(per_slot)}; raise --expert-memory"
            )
    elif budget is None or everything + rest <= budget:
        return Residency(
            None,
            one,
            everything,
            f"all {num_experts} experts of {layers} MoE layers resident "
            f"({mib(everything)})"
            + ("" if budget is None else f" within the {mib(budget)} budget"),
        )
    else:
        slots = min(max(budget - rest, 0) // per_slot, num_experts - 1)
        while slots >= 1 and slot_pool_bytes(slots * per_slot, arena, carves) + rest > budget:
            slots -= 1
        if slots < 1:
            least = slot_pool_bytes(per_slot, arena, carves)
            raise ValueError(
                f"the memory budget ({mib(budget)}) cannot hold even the minimum for {spec.architecture}: one "
                f"expert slot per MoE layer ({mib(least)} with alignment) + the minimum KV pool ({mib(min_kv)}) "
                f"+ workspaces ({mib(workspaces)}) = {mib(least + rest)}; raise --memory-budget (or the GPU "
                "memory fraction), or lower --max-model-len / --kv-pool-size / max_batched_tokens"
            )
        return Residency(
            slots,
            one,
            slots * per_slot,
            (
                f"partial residency, {slots} of {num_experts} experts per MoE layer resident ({mib(slots * per_slot)} "
                f"of {mib(everything)}): all experts + the minimum KV pool ({mib(min_kv)}) + workspaces "
                f"({mib(workspaces)}) exceed the memory budget ({mib(budget)}); the others stay in host memory"
            ),
        )
    if slots >= num_experts:
        slots_used, device = None, everything
        reason = f"all {num_experts} experts of {layers} MoE layers resident ({mib(everything)}), set by {how}"
    else:
        slots_used, device = slots, slots * per_slot
        reason = (
            f"partial residency, {slots} of {num_experts} experts per MoE layer resident "
            f"({mib(device)} of {mib(everything)}), set by {how}"
        )
    if (
        budget is not None
        and (slot_pool_bytes(device, arena, carves) if slots_used else device) + rest > budget
    ):
        raise ValueError(
            f"{how} keeps {mib(device)} of experts resident, which with the minimum KV pool ({mib(min_kv)}) and "
            f"workspaces ({mib(workspaces)}) exceeds the memory budget ({mib(budget)}); lower it, or leave "
            "residency automatic"
        )
    return Residency(slots_used, one, device, reason)
