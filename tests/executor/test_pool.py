"""DevicePool: one allocation, arena-aligned carves, views that alias the buffer, clear exhaustion."""

from __future__ import annotations

import pytest
import torch
from sloserve.memory.pool import DevicePool, PoolExhaustedError

MiB = 1024**2


def test_carves_are_zeroed_views_of_one_buffer():
    pool = DevicePool(4 * MiB, arena_bytes=MiB)
    a = pool.carve("a", (16, 4), torch.float32)
    b = pool.carve("b", (8,), torch.int64)
    assert a.shape == (16, 4) and a.dtype == torch.float32 and not a.any()
    assert b.shape == (8,) and b.dtype == torch.int64
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    a.fill_(1.0)
    b.fill_(7)
    assert a.sum().item() == 64 and b.sum().item() == 56  # no overlap


def test_large_carves_start_on_arena_boundaries_and_small_ones_fill_holes():
    pool = DevicePool(8 * MiB, arena_bytes=2 * MiB)
    pool.carve("small", (1024,), torch.uint8)
    pool.carve("big", (3 * MiB,), torch.uint8)  # takes arenas 1-2
    report = pool.report()
    assert report["carves"]["big"]["offset"] == 2 * MiB
    pool.carve("filler", (1024,), torch.uint8)  # goes into the hole left in arena 0
    assert pool.report()["carves"]["filler"]["offset"] < 2 * MiB
    assert pool.report()["arenas_used"] == 3
    # arena 3 untouched (arena 2's tail is not contiguous-large)
    assert pool.free_bytes() == 2 * MiB


def test_small_carves_do_not_cross_arena_boundaries():
    pool = DevicePool(4 * MiB, arena_bytes=MiB)
    pool.carve("x", (MiB - 512,), torch.uint8)
    pool.carve("y", (1024,), torch.uint8)
    assert pool.report()["carves"]["y"]["offset"] == MiB


def test_exhaustion_names_the_carve_and_what_to_change():
    pool = DevicePool(2 * MiB, arena_bytes=MiB)
    pool.carve("kv", (MiB // 2,), torch.float32)  # all 2 MiB
    with pytest.raises(PoolExhaustedError, match=r"'more'.*kv_pool_bytes"):
        pool.carve("more", (16,), torch.float32)


def test_duplicate_names_and_bad_sizes_are_rejected():
    pool = DevicePool(MiB)
    pool.carve("a", (4,), torch.float32)
    with pytest.raises(ValueError, match="already holds"):
        pool.carve("a", (4,), torch.float32)
    with pytest.raises(ValueError, match="> 0"):
        DevicePool(0)


def test_report_counts_bytes_and_arenas():
    pool = DevicePool(3 * MiB, arena_bytes=MiB)
    pool.carve("w", (256, 256), torch.float32)  # 256 KiB
    report = pool.report()
    assert report["total_bytes"] == 3 * MiB and report["num_arenas"] == 3
    assert report["used_bytes"] == 256 * 1024 and report["free_bytes"] == 3 * MiB - 256 * 1024
    assert report["carves"]["w"]["shape"] == [256, 256]
    assert report["pinned"] is False  # no CUDA here: never pinned


def test_a_pool_with_more_pages_than_the_block_allocator_can_index_is_refused(
    monkeypatch, tiny_llama
):
    from sloserve.config import CacheConfig, ModelConfig, SloserveConfig
    from sloserve.executor import plan as plan_module
    from sloserve.models.spec import load_spec

    monkeypatch.setattr(plan_module, "MAX_BLOCKS", 100)
    config = SloserveConfig(
        model=ModelConfig(device="cpu", max_model_len=64),
        cache=CacheConfig(block_size=16, kv_pool_bytes=64 * 2**20),
    )
    spec = load_spec(tiny_llama)
    with pytest.raises(ValueError, match="more than the block allocator's limit of 100"):
        plan_module.plan_memory(config, spec, 64, torch.device("cpu"), torch.float32, 16)
