"""How the runner's one device pool is divided: KV pages, expert slots, input and MoE workspaces."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sloserve.config import SloserveConfig
from sloserve.executor.inputs import workspace_bytes
from sloserve.executor.residency import Residency, choose_residency, slot_pool_bytes
from sloserve.hotpath import MAX_BLOCKS
from sloserve.layers.attention.kv_int8 import row_bytes
from sloserve.memory.expert_cache import ExpertStore
from sloserve.memory.pool import CPU_DEFAULT_POOL_BYTES, default_arena_bytes, default_pool_bytes
from sloserve.models.spec import ModelSpec

# DevicePool rounds its size up to a multiple of this: a budget keeps room for it
POOL_ROUNDING = 256


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    max_step_tokens: int  # flat tokens one step may hold
    max_seqs: int  # sequences one step may hold
    max_blocks: int  # KV blocks of the longest sequence
    page_bytes: int  # one KV page, all layers, K and V
    num_pages: int  # KV pages incl. the null page 0
    expert_slots: int | None  # resident experts per MoE layer when partial, else None
    workspace_bytes: int
    # pool bytes of the expert slots (partial residency), alignment included; else 0
    expert_bytes: int
    # (token, expert) pairs of one MoE layer's step workspace; 0 without MoE
    moe_workspace_rows: int
    moe_workspace_bytes: int  # that workspace plus the alignment holes its four carves may leave
    arena_bytes: int
    num_host_pages: int
    residency: Residency | None = None  # None for a dense model
    budget_bytes: int | None = None  # the device budget for experts + pool (None: unbounded)
    kv_dtype: torch.dtype | None = None  # the KV pages' dtype (None: the model's)
    kv_row: int | None = None  # elements of one (token, KV head) row (None: head_dim)

    def tokens_per_gib(self, block: int) -> float:
        """Tokens one GiB of these KV pages holds (all layers, K and V)."""
        return 2**30 / self.page_bytes * block

    @property
    def overhead_bytes(self) -> int:
        """Input and MoE workspaces, two arenas of slack for boundary alignment, the pool's own rounding."""
        return overhead(self.workspace_bytes, self.moe_workspace_bytes, self.arena_bytes)

    @property
    def pool_bytes(self) -> int:
        """KV + expert slots + the workspaces and arena slack (the pool rounds this up to its alignment)."""
        return (
            self.num_pages * self.page_bytes
            + self.expert_bytes
            + self.overhead_bytes
            - POOL_ROUNDING
        )


def graph_memory_bytes(spec: ModelSpec, max_seqs: int, itemsize: int) -> int:
    """What the captured decode steps hold (executor/graphs.py): the largest bucket's activations,
    which every smaller bucket reuses, twice over for what lives across a layer, plus 64 MiB for
    library workspaces."""
    inter = spec.intermediate_size or spec.moe_intermediate_size or 4 * spec.hidden_size
    row = (6 * spec.hidden_size + spec.q_size + 2 * spec.kv_size + 3 * inter) * itemsize
    logits = spec.vocab_size * (itemsize + 4)  # the LM head's output and its float32 copy
    return 2 * max_seqs * (row + logits) + 64 * 2**20


def kv_layout(kv_cache_dtype: str, dtype: torch.dtype, head_dim: int) -> tuple[torch.dtype, int]:
    """The KV pages' dtype and the elements of one (token, KV head) row: `dtype` and head_dim for
    'auto', int8 rows with their scales for 'int8' (layers/attention/kv_int8.py)."""
    if kv_cache_dtype == "int8":
        return torch.int8, row_bytes(head_dim)
    return dtype, head_dim


def overhead(workspace: int, moe_workspace: int, arena: int) -> int:
    return workspace + moe_workspace + 2 * arena + POOL_ROUNDING


def plan_memory(
    config: SloserveConfig,
    spec: ModelSpec,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    block: int,
) -> MemoryPlan:
    """Size everything once, before the one allocation; ValueError when the KV cannot hold one sequence.

    block is the resolved KV page size (the attention backend's choice when the config sets none),
    never config.cache.block_size, which may be None.
    """
    cc, sc = config.cache, config.scheduler
    max_blocks = math.ceil(max_model_len / block)
    max_step_tokens = (
        sc.max_batched_tokens if sc.chunked_prefill else max(sc.max_batched_tokens, max_model_len)
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_dtype, kv_row = kv_layout(cc.kv_cache_dtype, dtype, spec.head_dim)
    if kv_dtype == torch.int8 and device.type != "cpu":
        raise ValueError(
            f"--kv-cache-dtype int8 runs on a CPU only, not on {device.type} (FP8 KV on a GPU is "
            "another kind): drop it (or pass --device cpu)"
        )
    kv_itemsize = torch.empty((), dtype=kv_dtype).element_size()
    token_bytes = spec.num_layers * 2 * spec.num_kv_heads * kv_row * kv_itemsize
    page_bytes = token_bytes * block
    ws_bytes = workspace_bytes(max_step_tokens, sc.max_batch, max_blocks)
    arena = cc.arena_bytes or default_arena_bytes(device)
    moe_rows = max_step_tokens * spec.top_k if spec.moe_layers else 0
    moe_bytes = 0
    if moe_rows:
        moe_bytes = ExpertStore.workspace_bytes(
            moe_rows, spec.hidden_size, spec.moe_intermediate_size, dtype
        )
        # A carve skips at most min(its size, one arena) to respect arena boundaries; four carves.
        moe_bytes += min(moe_bytes, 4 * arena)
    fixed = overhead(ws_bytes, moe_bytes, arena)
    budget = cc.memory_budget_bytes
    # measured after the dense weights (experts wait on the host)
    if budget is None and device.type == "cuda":
        budget = default_pool_bytes(device, cc.gpu_memory_fraction)
    residency = None
    expert_device = slot_bytes = 0
    if spec.moe_layers:
        min_kv = cc.kv_pool_bytes if cc.kv_pool_bytes is not None else (max_blocks + 1) * page_bytes
        int8 = config.model.quantization == "int8"
        residency = choose_residency(cc, spec, itemsize, budget, min_kv, fixed, arena, int8)
        expert_device = residency.device_bytes
        if residency.partial:
            carves = 4 if int8 else 2
            expert_device = slot_bytes = slot_pool_bytes(residency.device_bytes, arena, carves)
    kv_bytes = cc.kv_pool_bytes
    if kv_bytes is None:
        if device.type == "cuda" or budget is not None:
            kv_bytes = budget - expert_device - fixed
        if device.type == "cuda" and config.model.enforce_eager is not True and not spec.moe_layers:
            # the captured decode steps'
            kv_bytes -= graph_memory_bytes(spec, sc.max_batch, itemsize)
        if device.type != "cuda":  # enough for max_batch full-length sequences, capped
            cpu = min(
                CPU_DEFAULT_POOL_BYTES, token_bytes * max_model_len * sc.max_batch + page_bytes
            )
            kv_bytes = cpu if kv_bytes is None else min(cpu, kv_bytes)
    num_pages = max(kv_bytes, 0) // page_bytes
    if num_pages - 1 < max_blocks:
        raise ValueError(
            f"the KV pool holds {max(num_pages - 1, 0)} pages of {block} tokens, fewer than one "
            f"{max_model_len}-token sequence needs ({max_blocks}); raise kv_pool_bytes (--kv-pool-size)"
            + (
                " or the memory budget (--memory-budget)"
                if cc.memory_budget_bytes is not None
                else ""
            )
            + " or lower max_model_len"
        )
    if num_pages > MAX_BLOCKS:
        raise ValueError(
            f"the KV pool would hold {num_pages} pages of {block} tokens, more than the block allocator's "
            f"limit of {MAX_BLOCKS}; lower kv_pool_bytes (--kv-pool-size) or raise the block size"
        )
    return MemoryPlan(
        max_step_tokens=max_step_tokens,
        max_seqs=sc.max_batch,
        max_blocks=max_blocks,
        page_bytes=page_bytes,
        num_pages=num_pages,
        expert_slots=residency.slots if residency else None,
        workspace_bytes=ws_bytes,
        expert_bytes=slot_bytes,
        moe_workspace_rows=moe_rows,
        moe_workspace_bytes=moe_bytes,
        arena_bytes=arena,
        num_host_pages=min(cc.swap_bytes // page_bytes, num_pages),
        residency=residency,
        budget_bytes=budget,
        kv_dtype=kv_dtype,
        kv_row=kv_row,
    )
