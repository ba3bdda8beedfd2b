"""Expert residency as a setting and as a decision: slots, expert memory, the budget, the start-up errors."""

from __future__ import annotations

import logging

import pytest
import torch
from sloserve.config import CacheConfig
from sloserve.executor.plan import plan_memory
from sloserve.executor.residency import choose_residency, expert_bytes, slot_pool_bytes
from sloserve.models.spec import load_spec

from tests.executor.conftest import runner_config
from tests.executor.driver import generate

PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80, 90], [256, 7, 7, 7], [256, 99, 3, 14, 15, 92, 65]]
ARENA = 16 * 1024
SMALL = dict(max_model_len=64, max_batched_tokens=32, kv_pool_bytes=None, arena_bytes=ARENA)


def small_config(folder, **cache):
    """A CPU runner config with small workspaces, so budgets of a few hundred KiB mean something."""
    kw = dict(SMALL)
    cfg = runner_config(
        folder,
        max_model_len=kw.pop("max_model_len"),
        max_batched_tokens=kw.pop("max_batched_tokens"),
        kv_pool_bytes=None,
    )
    cfg.cache = CacheConfig(block_size=4, swap_bytes=2**20, **{**kw, **cache})
    return cfg


def sizes(folder) -> dict:
    """What the plan needs besides the experts, and what the experts take, for this checkpoint."""
    spec = load_spec(folder)
    plan = plan_memory(small_config(folder), spec, 64, torch.device("cpu"), torch.float32, 4)
    everything = plan.residency.device_bytes
    return {
        "spec": spec,
        "fixed": plan.overhead_bytes,
        "min_kv": (plan.max_blocks + 1) * plan.page_bytes,
        "everything": everything,
        "per_slot": everything // spec.num_experts,
    }


def plan_with(folder, **cache):
    return plan_memory(
        small_config(folder, **cache), load_spec(folder), 64, torch.device("cpu"), torch.float32, 4
    )


# -- the decision ---------------------------------------------------------------------------------


def test_everything_resident_when_it_fits(tiny_mixtral):
    s = sizes(tiny_mixtral)
    assert s["per_slot"] == 2 * expert_bytes(s["spec"], 4) == 2 * 3 * 128 * 64 * 4  # 2 MoE layers
    unbounded = plan_with(tiny_mixtral)
    assert (
        unbounded.residency.slots is None
        and unbounded.expert_slots is None
        and unbounded.expert_bytes == 0
    )
    exact = plan_with(tiny_mixtral, memory_budget_bytes=s["everything"] + s["min_kv"] + s["fixed"])
    assert exact.residency.slots is None and "all 4 experts" in exact.residency.reason
    # the KV pool takes what is left: the minimum
    assert exact.num_pages == s["min_kv"] // exact.page_bytes


def test_a_budget_short_of_all_experts_chooses_partial_residency(tiny_mixtral):
    s = sizes(tiny_mixtral)
    budget = (
        s["min_kv"] + s["fixed"] + slot_pool_bytes(2 * s["per_slot"], ARENA) + s["per_slot"] // 2
    )
    plan = plan_with(tiny_mixtral, memory_budget_bytes=budget)
    assert plan.residency.slots == plan.expert_slots == 2
    assert plan.expert_bytes == slot_pool_bytes(2 * s["per_slot"], ARENA)
    assert plan.pool_bytes <= budget  # slots, KV, workspaces and alignment all inside the budget
    assert plan.num_pages - 1 >= plan.max_blocks  # at least one full-length sequence of KV
    reason = plan.residency.reason
    assert "partial residency, 2 of 4 experts" in reason and "exceed the memory budget" in reason


def test_a_budget_short_of_the_minimum_is_a_clear_error(tiny_mixtral):
    s = sizes(tiny_mixtral)
    least = s["min_kv"] + s["fixed"] + slot_pool_bytes(s["per_slot"], ARENA)
    assert plan_with(tiny_mixtral, memory_budget_bytes=least).residency.slots == 1
    with pytest.raises(
        ValueError,
        match=r"cannot hold even the minimum.*one expert slot per MoE layer.*"
        r"minimum KV pool.*raise --memory-budget",
    ):
        plan_with(tiny_mixtral, memory_budget_bytes=least - 1)


def test_explicit_slots_and_expert_memory(tiny_mixtral):
    s = sizes(tiny_mixtral)
    assert plan_with(tiny_mixtral, expert_slots_per_layer=1).expert_slots == 1
    # all of them: all resident
    assert plan_with(tiny_mixtral, expert_slots_per_layer=4).expert_slots is None
    assert plan_with(tiny_mixtral, expert_slots_per_layer=9).expert_slots is None
    plan = plan_with(tiny_mixtral, expert_memory_bytes=3 * s["per_slot"] + 1)
    assert plan.expert_slots == 3 and "set by expert_memory_bytes" in plan.residency.reason
    with pytest.raises(ValueError, match="holds no expert slot.*raise --expert-memory"):
        plan_with(tiny_mixtral, expert_memory_bytes=s["per_slot"] - 1)
    with pytest.raises(
        ValueError, match="expert_slots_per_layer keeps .* exceeds the memory budget"
    ):
        plan_with(
            tiny_mixtral,
            expert_slots_per_layer=3,
            memory_budget_bytes=s["min_kv"] + s["fixed"] + 2 * s["per_slot"],
        )


def test_config_rejects_conflicting_residency_settings():
    with pytest.raises(ValueError, match="give only one"):
        CacheConfig(expert_slots_per_layer=2, expert_memory_bytes=2**20)
    with pytest.raises(ValueError, match="expert slots per layer must be >= 1"):
        CacheConfig(expert_slots_per_layer=0)
    with pytest.raises(ValueError, match="memory budget must be > 0"):
        CacheConfig(memory_budget_bytes=0)


def test_dense_models_only_take_the_budget_for_kv(tiny_llama):
    plan = plan_with(tiny_llama, memory_budget_bytes=2 * 2**20)
    assert plan.residency is None and plan.pool_bytes <= 2 * 2**20


def test_choose_residency_never_picks_all_experts_when_they_do_not_fit(tiny_qwen2_moe):
    spec = load_spec(tiny_qwen2_moe)
    one = expert_bytes(spec, 4) * len(spec.moe_layers)
    r = choose_residency(
        CacheConfig(), spec, 4, budget=4 * one + 1000 - 1, min_kv=500, workspaces=500, arena=1
    )
    assert r.slots == 3 and r.partial


# -- through the runner ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_runner_starts_partial_under_a_small_budget_and_logs_why(make_checkpoint, arch, caplog):
    from sloserve.executor import ModelRunner

    folder = make_checkpoint(arch)
    s = sizes(folder)
    full = generate(ModelRunner(small_config(folder)), PROMPTS, 6)
    budget = s["min_kv"] + s["fixed"] + slot_pool_bytes(2 * s["per_slot"], ARENA)
    with caplog.at_level(logging.INFO, logger="sloserve.executor.runner"):
        runner = ModelRunner(small_config(folder, memory_budget_bytes=budget))
    warned = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "experts: partial residency" in r.message
    ]
    assert (
        warned
        and "2 of 4 experts" in warned[0].message
        and "exceed the memory budget" in warned[0].message
    )
    assert (
        runner.info()["expert_residency"] == "partial"
        and runner.info()["expert_slots_per_layer"] == 2
    )
    assert runner.pool.total_bytes <= budget
    assert generate(runner, PROMPTS, 6) == full
    assert runner.experts.stats()["misses"] > 0


def test_runner_refuses_to_start_below_the_minimum(tiny_mixtral):
    from sloserve.executor import ModelRunner

    s = sizes(tiny_mixtral)
    with pytest.raises(ValueError, match="cannot hold even the minimum"):
        ModelRunner(small_config(tiny_mixtral, memory_budget_bytes=s["min_kv"] + s["fixed"]))


def test_all_resident_runner_reports_its_experts(tiny_mixtral):
    from sloserve.executor import ModelRunner

    runner = ModelRunner(small_config(tiny_mixtral))
    info = runner.info()
    assert (info["expert_residency"], info["num_experts"], info["expert_slots_per_layer"]) == (
        "all",
        4,
        4,
    )
    assert info["expert_device_bytes"] == sizes(tiny_mixtral)["everything"]
    assert runner.expert_stats()["expert_resident_per_layer"] == [4, 4]


def test_llm_takes_residency_options(tiny_mixtral):
    from sloserve.llm import LLM
    from sloserve.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    kw = dict(
        device="cpu",
        block_size=4,
        kv_pool_bytes="2MiB",
        max_batch=4,
        max_model_len=64,
        policy="fifo",
    )
    full = [o.token_ids for o in LLM(str(tiny_mixtral), **kw).generate(PROMPTS, greedy)]
    # one 192 KiB slot per layer
    by_bytes = LLM(str(tiny_mixtral), expert_memory_bytes="200KiB", **kw)
    assert by_bytes.engine.runner.experts.slots_per_layer == 1
    assert [o.token_ids for o in by_bytes.generate(PROMPTS, greedy)] == full
    no_preload = LLM(str(tiny_mixtral), expert_slots_per_layer=2, expert_preload=False, **kw)
    assert [o.token_ids for o in no_preload.generate(PROMPTS, greedy)] == full
    assert no_preload.engine.stats().expert_prefetches_total == 0


def test_the_loader_keeps_experts_on_the_host_until_residency_is_decided(tiny_mixtral):
    from sloserve.models.loader import load_checkpoint

    _, weights = load_checkpoint(
        tiny_mixtral, torch.device("meta"), torch.float32, experts_on_host=True
    )
    assert weights.experts and all(
        t.device.type == "cpu" for pair in weights.experts.values() for t in pair
    )
    assert weights.embed.is_meta


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("slots", [None, 2])
def test_grouped_gemms_through_the_model_give_the_same_tokens(make_checkpoint, arch, slots):
    """The CUDA default (grouped GEMMs, no per-layer sync when all resident), forced on the CPU."""
    from sloserve.executor import ModelRunner

    folder = make_checkpoint(arch)
    plain = ModelRunner(small_config(folder, expert_slots_per_layer=slots))
    grouped = ModelRunner(small_config(folder, expert_slots_per_layer=slots))
    assert not grouped.experts.grouped
    grouped.experts.grouped = True
    assert generate(grouped, PROMPTS, 6, chunk=5) == generate(plain, PROMPTS, 6, chunk=5)


def test_the_offload_benchmark_compares_arms_on_the_same_tokens(tiny_mixtral):
    from benchmarks import moe_offload

    assert moe_offload.arms([25, 50, 100], [True, False]) == [
        (100, False),
        (50, True),
        (50, False),
        (25, True),
        (25, False),
    ]
    runs = moe_offload.compare(
        str(tiny_mixtral),
        "cpu",
        PROMPTS[:2],
        [3, 3],
        2,
        [50, 100],
        [True, False],
        64,
        log=lambda _line: None,
        block_size=4,
    )
    assert [(r["resident_pct"], r["slots_per_layer"], r["preload"]) for r in runs] == [
        (100, 4, False),
        (50, 2, True),
        (50, 2, False),
    ]
    assert all(r["tokens_equal_all_resident"] and r["output_tokens"] == 6 for r in runs)
    assert (
        runs[0]["tok_s_vs_all_resident"] == 1.0
        and runs[1]["expert_device_bytes"] < runs[0]["expert_device_bytes"]
    )
