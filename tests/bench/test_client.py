"""The load generator against a fake grpc.aio server with canned token timing."""

from __future__ import annotations

import pytest
from sloserve.bench.client import LoadSpec, connect, fetch_info, run_load
from sloserve.bench.stats import summarise
from sloserve.bench.workloads import WorkloadItem, load_workload
from sloserve.sampling_params import SLO

from tests.bench.fake_server import FakeBehaviour, start_fake


@pytest.fixture
async def fake():
    behaviour = FakeBehaviour()
    server, target = await start_fake(behaviour)
    channel = await connect(target)
    yield behaviour, channel
    await channel.close()
    await server.stop(0)


async def test_records_every_chunk_and_final(fake):
    behaviour, channel = fake
    items = load_workload("fixed:6,8", num_requests=12)
    result = await run_load(channel, items, LoadSpec(streams=3, slo=SLO(ttft_s=30.0)))
    assert len(result.records) == 12 and result.duration_s > 0
    for r in result.records:
        assert r.status == "ok" and r.finish_reason == "length"
        assert r.output_tokens == 8 and r.chunk_tokens == [1] * 8 and r.text == "x" * 8
        assert r.prompt_tokens == 6 and r.cached_tokens == 3
        assert len(r.itl) == 7 and 0 < r.ttft <= r.e2e
    sent = {m.request_id: m for m in behaviour.seen}
    assert len(sent) == 12
    first = next(iter(sent.values()))
    assert first.max_tokens == 8 and first.sampling.ignore_eos and first.slo.ttft_s == 30.0
    assert not first.slo.HasField("e2e_s")
    out = summarise(result.records, result.duration_s, SLO(ttft_s=30.0), result.rate)
    assert (
        out["completed"] == 12 and out["slo_attainment"] == 1.0 and out["prefix_hit_tokens"] == 36
    )


async def test_refusals_are_recorded_by_status_and_reason(fake):
    _, channel = fake
    items = [WorkloadItem("hello", 3), WorkloadItem("REFUSE me", 3)] * 3
    result = await run_load(channel, items, LoadSpec(streams=2))
    refused = [r for r in result.records if r.status == "refused"]
    assert len(refused) == 3
    assert {(r.error_code, r.error_reason) for r in refused} == {
        ("RESOURCE_EXHAUSTED", "slo_unattainable")
    }
    out = summarise(result.records, result.duration_s, None, None)
    assert out["refusals"] == {"RESOURCE_EXHAUSTED:slo_unattainable": 3}
    assert out["slo_attainment"] == pytest.approx(0.5)


async def test_closed_loop_never_exceeds_concurrency(fake):
    behaviour, channel = fake
    behaviour.max_in_flight = 2  # a third concurrent request would be refused
    items = load_workload("fixed:4,5", num_requests=10)
    result = await run_load(channel, items, LoadSpec(concurrency=2, streams=4))
    assert [r.status for r in result.records] == ["ok"] * 10


async def test_poisson_duration_mode_cycles_the_workload(fake):
    behaviour, channel = fake
    items = [WorkloadItem("a", 2), WorkloadItem("b", 2)]
    result = await run_load(channel, items, LoadSpec(rate=200.0, duration_s=0.3, seed=1))
    assert len(result.records) > 2 and all(r.status == "ok" for r in result.records)
    assert {m.text for m in behaviour.seen} == {"a", "b"}


async def test_exact_match_against_expected_outputs(fake):
    behaviour, channel = fake
    behaviour.answers = {"p1": "12\n34\n\nInput", "p2": "99\n"}
    items = [WorkloadItem("p1", 20, "12\n34\n", "t1"), WorkloadItem("p2", 20, "11\n", "t2")]
    result = await run_load(channel, items, LoadSpec())
    out = summarise(result.records, result.duration_s, None, None)
    assert out["exact_match"] == pytest.approx(0.5)


async def test_slow_requests_are_cancelled_after_the_timeout(fake):
    behaviour, channel = fake
    behaviour.token_s = 5.0
    result = await run_load(channel, [WorkloadItem("slow", 4)], LoadSpec(request_timeout_s=0.3))
    (r,) = result.records
    assert (r.status, r.error_code, r.error_reason) == (
        "failed",
        "DEADLINE_EXCEEDED",
        "client_timeout",
    )
    assert behaviour.cancelled == [r.request_id]


async def test_info_and_unreachable_server(fake):
    _, channel = fake
    assert (await fetch_info(channel))["model"] == "fake"
    with pytest.raises(ConnectionError, match="cannot reach a sloserve server at 127.0.0.1:1"):
        await connect("127.0.0.1:1", timeout_s=0.5)


def test_load_spec_validation():
    for kwargs in (
        {"rate": 0.0},
        {"concurrency": 0},
        {"streams": 0},
        {"duration_s": -1.0},
        {"duration_s": 1.0},
    ):
        with pytest.raises(ValueError):
            LoadSpec(**kwargs)
