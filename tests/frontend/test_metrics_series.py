"""The /metrics page dashboards and gateways read: model_name everywhere, no _created, new series move,
and the vllm:-named series behind --metrics-compat vllm."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, gen, live_server, read_until, wait_for

pytestmark = pytest.mark.timeout(60)
VLLM = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


async def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    url = f"http://127.0.0.1:{port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


MODEL = "served-name"  # --served-model-name: the model_name label


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


async def _traffic(server, stub, engine) -> None:
    """Three requests (one without objectives), watched while they hold KV blocks, and one bad request id."""
    call = stub.Stream()
    slo = pb.Slo(ttft_s=30.0, e2e_s=60.0)
    for rid, with_slo in (("a", True), ("b", True), ("c", False)):
        await call.write(gen(rid, max_tokens=12, slo=slo) if with_slo else gen(rid, max_tokens=12))
    await wait_for(lambda: engine.stats().running == 3)
    usage = server.metrics.registry.get_sample_value(
        "sloserve_kv_cache_usage_ratio", {"model_name": MODEL}
    )
    assert 0 < usage <= 1
    await call.write(gen("bad\x00id"))
    await read_until(call, Transcript(), {"a", "b", "c"})
    await call.done_writing()


@pytest.mark.parametrize("compat", ["none", "vllm"])
async def test_the_metrics_page_has_the_series_gateways_read(compat):
    engine = FakeEngine(step_s=0.01, max_running=8)
    async with live_server(
        engine, metrics_port=0, metrics_compat=compat, served_model_name=MODEL
    ) as (server, stub, _):
        await _traffic(server, stub, engine)
        samples = await _scrape(server.metrics_port)
    assert all(dict(labels).get("model_name") == MODEL for _, labels in samples)
    assert not [name for name, _ in samples if name.endswith("_created")]
    assert _value(samples, "sloserve_kv_cache_usage_ratio") == 0  # every block is back
    assert _value(samples, "sloserve_queue_seconds_count") == 3
    assert _value(samples, "sloserve_inter_token_latency_seconds_count") >= 3
    assert _value(samples, "sloserve_slo_requests_total", slo_class="none", outcome="unjudged") == 1
    assert (
        _value(samples, "sloserve_slo_requests_total", slo_class="interactive", outcome="met") == 2
    )
    assert (
        "sloserve_slo_requests_total",
        tuple(sorted({"model_name": MODEL, "slo_class": "none", "outcome": "met"}.items())),
    ) not in samples
    assert _value(samples, "sloserve_limit_refusals_total", limit="request_id_charset") == 1
    names = {name for name, _ in samples}
    if compat == "none":
        assert not [name for name in names if name.startswith("vllm:")]
        return
    for name in VLLM:
        assert any(n == name or n.startswith((f"{name}_", f"{name}_total")) for n in names), name
    assert _value(samples, "vllm:time_to_first_token_seconds_count") == _value(
        samples, "sloserve_ttft_seconds_count"
    )
    assert _value(samples, "vllm:e2e_request_latency_seconds_count") == 3
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 3
    assert (
        _value(samples, "vllm:generation_tokens_total")
        == _value(samples, "sloserve_generated_tokens_total")
        > 0
    )
    assert _value(samples, "vllm:num_requests_running") == 0
    assert _value(samples, "vllm:kv_cache_usage_perc") == 0
