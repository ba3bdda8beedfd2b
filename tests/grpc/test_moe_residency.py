"""MoE expert residency through the real server: greedy tokens over gRPC at 25% / 50% / 100% of the
experts resident are equal; Info, Prometheus and `sloserve info --json` report the expert cache."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.engine import AsyncEngine, wire
from sloserve.engine.outputs import EngineStats
from sloserve.grpc.server import SloserveServer
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.live_server import Transcript, gen, read_until, wait_for

pytestmark = pytest.mark.timeout(180)

PROMPTS = {
    f"r{i}": text
    for i, text in enumerate(
        ["Input:\n12\n34\nOutput:\n", "0000\n1111\n", "abc", "Output:\n9 8 7\n6 5 4\n", "x"]
    )
}
MAX_TOKENS = 10


def config(folder, slots: int | None, preload: bool = True) -> SloserveConfig:
    return SloserveConfig(
        model=ModelConfig(path=str(folder), device="cpu"),
        cache=CacheConfig(
            block_size=4,
            kv_pool_bytes=2 * 2**20,
            swap_bytes=2**20,
            expert_slots_per_layer=slots,
            expert_preload=preload,
        ),
        scheduler=SchedulerConfig(max_batch=4, admission_control=False),
        server=ServerConfig(port=0, metrics_port=None),
    )


async def serve_and_generate(folder, slots: int | None, preload: bool = True, *, inspect=None):
    """Start a real server (in-process engine) on `folder`, stream every prompt greedily, stop it."""
    cfg = config(folder, slots, preload)
    engine = AsyncEngine(cfg)
    server = SloserveServer(cfg, engine, watchdog_interval_s=0.05)
    await server.start()
    await wait_for(lambda: engine.ready, timeout=60)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.SloserveStub(channel)
        call = stub.Stream()
        for rid, text in PROMPTS.items():
            await call.write(
                gen(
                    rid,
                    text=text,
                    max_tokens=MAX_TOKENS,
                    sampling=pb.SamplingParams(ignore_eos=True),
                )
            )
        transcript = Transcript()
        await read_until(call, transcript, set(PROMPTS))
        await call.done_writing()
        extra = await inspect(server, stub) if inspect else None
        return {rid: transcript.tokens(rid) for rid in PROMPTS}, extra
    finally:
        await channel.close()
        await server.stop(grace_s=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
async def test_greedy_tokens_over_grpc_equal_at_any_residency(make_checkpoint, arch):
    folder = make_checkpoint(arch)  # 4 experts per layer: 1 slot is 25%, 2 slots 50%
    full, _ = await serve_and_generate(folder, None)
    assert all(len(tokens) == MAX_TOKENS for tokens in full.values())
    for slots, preload in ((2, True), (1, True), (2, False)):
        partial, _ = await serve_and_generate(folder, slots, preload)
        assert partial == full, f"{arch}: {slots} of 4 experts resident, preload {preload}"


async def test_info_and_metrics_report_the_expert_cache(tiny_mixtral):
    async def inspect(server, stub):
        info = await stub.Info(pb.InfoRequest())
        metrics = {m.name: m for m in server.metrics.registry.collect()}
        address = f"127.0.0.1:{server.port}"
        result = await asyncio.to_thread(
            CliRunner().invoke, cli, ["info", "--server", address, "--json"]
        )
        return info, metrics, result

    _, (info, metrics, result) = await serve_and_generate(tiny_mixtral, 2, inspect=inspect)
    assert (info.expert_residency, info.num_experts, info.expert_slots_per_layer) == (
        "partial",
        4,
        2,
    )
    # 2 layers x 2 slots x one float32 expert
    assert info.expert_device_bytes == 2 * 2 * 3 * 128 * 64 * 4
    s = info.stats
    assert list(s.expert_resident_per_layer) == [2, 2]
    assert s.expert_hits_total > 0 and s.expert_misses_total > 0 and 0 < s.expert_hit_rate < 1
    assert (
        s.expert_bytes_copied_total > 0
        and s.expert_bytes_per_step >= 0
        and s.expert_miss_stall_s_total > 0
    )
    assert s.expert_prediction_recall > 0  # decode steps carried a prediction
    resident = metrics["sloserve_expert_resident"]
    assert sorted((x.labels["moe_layer"], x.value) for x in resident.samples) == [
        ("0", 2.0),
        ("1", 2.0),
    ]
    for name in (
        "sloserve_expert_hits",
        "sloserve_expert_misses",
        "sloserve_expert_hit_rate",
        "sloserve_expert_prefetch_accuracy",
        "sloserve_expert_prediction_recall",
        "sloserve_expert_copied_bytes",
        "sloserve_expert_copied_bytes_per_step",
        "sloserve_expert_miss_stall_seconds",
        "sloserve_expert_prefetches",
    ):
        assert name in metrics, name
    assert metrics["sloserve_expert_hit_rate"].samples[0].value == pytest.approx(s.expert_hit_rate)
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.output)
    assert data["expert_residency"] == "partial" and data["expert_slots_per_layer"] == 2
    assert data["expert_resident_per_layer"] == [2, 2] and data["expert_hits_total"] > 0
    assert {
        "expert_hit_rate",
        "expert_prefetch_accuracy",
        "expert_bytes_per_step",
        "expert_miss_stall_s_total",
        "expert_device_bytes",
    } <= set(data)


async def test_a_dense_model_reports_no_expert_cache(tiny_llama):
    async def inspect(server, stub):
        return await stub.Info(pb.InfoRequest()), {
            m.name for m in server.metrics.registry.collect()
        }

    _, (info, names) = await serve_and_generate(tiny_llama, None, inspect=inspect)
    assert (
        info.expert_residency == "none"
        and info.num_experts == 0
        and not info.stats.expert_resident_per_layer
    )
    assert not any(name.startswith("sloserve_expert_") for name in names)


def test_local_info_json_shows_the_expert_fields(tiny_qwen2_moe):
    result = CliRunner().invoke(
        cli,
        [
            "info",
            "--model",
            str(tiny_qwen2_moe),
            "--device",
            "cpu",
            "--json",
            "--expert-slots-per-layer",
            "1",
            "--kv-pool-size",
            "2MiB",
            "--block-size",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.output[result.output.index("{") :])
    assert (data["expert_residency"], data["num_experts"], data["expert_slots_per_layer"]) == (
        "partial",
        4,
        1,
    )
    assert data["expert_resident_per_layer"] == [1, 1]  # the warm-up steps filled the one slot
    # counted from the end of warm-up
    assert data["expert_hits_total"] == 0 and data["expert_hit_rate"] == 1.0
    assert data["expert_device_bytes"] > 0


def test_expert_stats_cross_the_engine_process_boundary():
    stats = EngineStats(
        expert_resident_per_layer=[3, 4],
        expert_hits_total=7,
        expert_hit_rate=0.875,
        expert_bytes_per_step=1.5e6,
        expert_miss_stall_s_total=0.25,
    )
    back = wire.decode_from_engine(wire.encode(wire.StepOutputs([], stats)))
    assert back.stats == stats


def test_a_budget_below_the_minimum_is_a_clear_start_up_error(tiny_mixtral):
    result = CliRunner().invoke(
        cli,
        [
            "info",
            "--model",
            str(tiny_mixtral),
            "--device",
            "cpu",
            "--memory-budget",
            "300KiB",
            "--block-size",
            "4",
        ],
    )
    assert result.exit_code != 0
    assert "cannot hold even the minimum" in result.output and "--memory-budget" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--expert-slots-per-layer", "2", "--expert-memory", "1MiB"],
            "--expert-slots-per-layer: expert slots per layer and expert memory both set residency",
        ),
        (
            ["--expert-slots-per-layer", "0"],
            "--expert-slots-per-layer: expert slots per layer must be >= 1",
        ),
        (["--memory-budget", "lots"], "--memory-budget: cannot read size 'lots'"),
        (["--expert-memory", "-1"], "--expert-memory: cannot read size"),
    ],
)
def test_residency_flags_are_checked_before_loading(tiny_mixtral, args, message):
    result = CliRunner().invoke(cli, ["info", "--model", str(tiny_mixtral), *args])
    assert result.exit_code != 0 and message in result.output, result.output
