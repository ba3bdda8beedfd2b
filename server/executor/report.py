"""What a runner reports: its load and memory layout (info), and its experts' fixed facts and counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sloserve.executor.compiled import DecodeStep
from sloserve.executor.graphs import GraphDecode
from sloserve.memory.expert_cache import ExpertStore

if TYPE_CHECKING:
    from sloserve.executor.runner import ModelRunner


def runner_info(runner: ModelRunner) -> dict:
    """What is loaded and how memory is laid out."""
    info = {
        "model": str(runner.model_path),
        "architecture": runner.spec.architecture,
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "dtype_reason": runner.dtype_reason,
        "attention_backend": runner.backend.name,
        "parameters": runner.num_parameters,
        "max_model_len": runner.max_model_len,
        "block_size": runner.block_size,
        "num_kv_blocks": runner.num_kv_blocks,
        "num_host_blocks": runner.num_host_blocks,
        "kv_page_bytes": runner.page_bytes,
        "kv_block_bytes": runner.kv_block_bytes,  # one block, all layers, K and V (InfoResponse)
        "pool": runner.pool.report(),
        "load_time_s": round(runner.load_time_s, 3),
        "decode_step": decode_mode(runner.decode_step),
        "warmup_time_s": round(runner.warmup_time_s, 3),
    }
    info.update(expert_info(runner.experts))
    if runner.experts is not None:
        info["experts"] = runner.experts.stats()
    return info


def decode_mode(step: DecodeStep | GraphDecode | None) -> str:
    """none, compiled, eager (CPU) or the capture of a GPU's bucketed step: cuda-graph or eager."""
    if step is None:
        return "none"
    if isinstance(step, GraphDecode):
        return step.mode
    return "compiled" if step.compiled else "eager"


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
