"""What a runner reports beside its info(): its decode path's mode, resident weight bytes, its experts'
fixed facts and counters."""

from __future__ import annotations

from sloserve.executor.compiled import DecodeStep
from sloserve.executor.graphs import GraphDecode
from sloserve.memory.expert_cache import ExpertStore
from sloserve.models.weights import ModelWeights


def decode_mode(step: DecodeStep | GraphDecode | None) -> str:
    """none, compiled, eager (CPU) or the capture of a GPU's bucketed step: cuda-graph or eager."""
    if step is None:
        return "none"
    if isinstance(step, GraphDecode):
        return step.mode
    return "compiled" if step.compiled else "eager"


def weight_bytes(weights: ModelWeights, store: ExpertStore | None) -> int:
    """Bytes every weight holds, each once, in the form its kernel reads (packed copies at their own size).

    The experts count where the store keeps them: all resident, or their host copies plus the
    device slots of partial residency.
    """
    total = weights.nbytes()
    if store is not None:
        total += store.device_bytes
        if store.partial:
            total += len(store.layers) * store.num_experts * store.expert_bytes
    return total


def expert_info(store: ExpertStore | None) -> dict:
    """What stays fixed about the experts (InfoResponse): residency, experts, slots, device bytes."""
    if store is None:
        return {
            "expert_residency": "none",
            "num_experts": 0,
            "expert_slots_per_layer": 0,
            "expert_device_bytes": 0,
        }
    return {
        "expert_residency": "partial" if store.partial else "all",
        "num_experts": store.num_experts,
        "expert_slots_per_layer": store.slots_per_layer,
        "expert_device_bytes": store.device_bytes,
    }


def expert_stats(store: ExpertStore | None) -> dict:
    """The EngineStats expert fields (cheap: host counters only, no device read); {} without experts."""
    if store is None:
        return {}
    c = store.counters.as_dict()
    return {
        "expert_resident_per_layer": store.resident(),
        "expert_hits_total": c["hits"],
        "expert_misses_total": c["misses"],
        "expert_hit_rate": c["hit_rate"],
        "expert_prefetches_total": c["prefetches"],
        "expert_prefetch_accuracy": c["prefetch_accuracy"],
        "expert_prediction_recall": c["prediction_recall"],
        "expert_bytes_copied_total": c["bytes_copied"] + c["preload_bytes"],
        "expert_bytes_per_step": c["bytes_per_step"],
        "expert_miss_stall_s_total": c["miss_stall_s"],
    }
