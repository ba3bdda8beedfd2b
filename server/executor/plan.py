"""How the runner's one device pool is divided: KV pages, expert slots, input and MoE workspaces."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sloserve.config import SloserveConfig
from sloserve.executor.inputs import workspace_bytes
from sloserve.hotpath import MAX_BLOCKS
from sloserve.memory.expert_cache import ExpertStore
from sloserve.memory.pool import CPU_DEFAULT_POOL_BYTES, default_arena_bytes, default_pool_bytes
from sloserve.models.spec import ModelSpec


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    max_tokens: int  # flat tokens one step may hold
    max_seqs: int  # sequences one step may hold
    max_blocks: int  # KV blocks of the longest sequence
    page_bytes: int  # one KV page, all layers, K and V
    num_pages: int  # KV pages incl. the null page 0
    expert_slots: int | None  # resident experts per MoE layer when partial, else None
    workspace_bytes: int
    expert_bytes: int
    moe_workspace_rows: int  # (token, expert) pairs of one MoE layer's step workspace; 0 without MoE
    moe_workspace_bytes: int  # that workspace plus the alignment holes its four carves may leave
    arena_bytes: int
    num_host_pages: int

    @property
    def pool_bytes(self) -> int:
        """KV + expert slots + input and MoE workspaces, plus two arenas of slack for boundary alignment."""
        kv = self.num_pages * self.page_bytes
        return kv + self.expert_bytes + self.workspace_bytes + self.moe_workspace_bytes + 2 * self.arena_bytes


def plan_memory(config: SloserveConfig, spec: ModelSpec, max_model_len: int, device: torch.device,
                dtype: torch.dtype, block: int) -> MemoryPlan:
    """Size everything once, before the one allocation; ValueError when the KV cannot hold one sequence.

    block is the resolved KV page size (the attention backend's choice when the config sets none),
    never config.cache.block_size, which may be None.
    """
    cc, sc = config.cache, config.scheduler
    max_blocks = math.ceil(max_model_len / block)
    max_tokens = sc.max_batched_tokens if sc.chunked_prefill else max(sc.max_batched_tokens, max_model_len)
    itemsize = torch.empty((), dtype=dtype).element_size()
    token_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * itemsize
    page_bytes = token_bytes * block
    slots = cc.expert_slots_per_layer
    partial = bool(spec.moe_layers) and slots is not None and slots < spec.num_experts
    expert_bytes = len(spec.moe_layers) * slots * 3 * spec.moe_intermediate_size * spec.hidden_size * itemsize \
        if partial else 0
    ws_bytes = workspace_bytes(max_tokens, sc.max_batch, max_blocks)
    arena = cc.arena_bytes or default_arena_bytes(device)
    moe_rows = max_tokens * spec.top_k if spec.moe_layers else 0
    moe_bytes = 0
    if moe_rows:
        moe_bytes = ExpertStore.workspace_bytes(moe_rows, spec.hidden_size, spec.moe_intermediate_size, dtype)
        # A carve skips at most min(its size, one arena) to respect arena boundaries; four carves.
        moe_bytes += min(moe_bytes, 4 * arena)
    kv_bytes = cc.kv_pool_bytes
    if kv_bytes is None:
        if device.type == "cuda":
            kv_bytes = default_pool_bytes(device, cc.gpu_memory_fraction) - ws_bytes - expert_bytes - moe_bytes \
                - 2 * arena
        else:  # enough for max_batch full-length sequences, capped
            kv_bytes = min(CPU_DEFAULT_POOL_BYTES, token_bytes * max_model_len * sc.max_batch + page_bytes)
    num_pages = max(kv_bytes, 0) // page_bytes
    if num_pages - 1 < max_blocks:
        raise ValueError(
            f"the KV pool holds {max(num_pages - 1, 0)} pages of {block} tokens, fewer than one "
            f"{max_model_len}-token sequence needs ({max_blocks}); raise kv_pool_bytes (--kv-pool-size) "
            "or lower max_model_len"
        )
    if num_pages > MAX_BLOCKS:
        raise ValueError(
            f"the KV pool would hold {num_pages} pages of {block} tokens, more than the block allocator's "
            f"limit of {MAX_BLOCKS}; lower kv_pool_bytes (--kv-pool-size) or raise the block size")
    return MemoryPlan(
        max_tokens=max_tokens, max_seqs=sc.max_batch, max_blocks=max_blocks, page_bytes=page_bytes,
        num_pages=num_pages, expert_slots=slots if partial else None, workspace_bytes=ws_bytes,
        expert_bytes=expert_bytes, moe_workspace_rows=moe_rows, moe_workspace_bytes=moe_bytes, arena_bytes=arena,
        num_host_pages=min(cc.swap_bytes // page_bytes, num_pages),
    )
