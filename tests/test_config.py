"""The typed config and request parameters reject bad values with messages that say what to change."""

import math

import pytest
from sloserve.config import (
    CacheConfig,
    GrpcConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SloserveConfig,
    parse_size,
)
from sloserve.errors import InvalidRequestError
from sloserve.sampling_params import SLO, SamplingParams


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("2GiB", 2 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("16 MiB", 16 * 1024**2),
        ("8K", 8000),
        (4096, 4096),
    ],
)
def test_parse_size_accepts_common_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "2XB", "0", 0, -5])
def test_parse_size_rejects_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: SchedulerConfig(policy="lifo"), "policy must be one of slo, priority, fifo"),
        (lambda: SchedulerConfig(max_batch=0), "max batch must be >= 1"),
        (lambda: SchedulerConfig(batch_decay=1.0), r"batch decay must be in \(0, 1\)"),
        (lambda: SchedulerConfig(preemption_mode="drop"), "preemption mode"),
        (lambda: SchedulerConfig(max_wait_s=math.nan), "max wait"),
        (lambda: CacheConfig(block_size=12), "power of two"),
        (lambda: ModelConfig(dtype="int4"), "dtype must be"),
        (lambda: ModelConfig(quantization="int4"), "quantization must be none or int8"),
        (lambda: ModelConfig(path=""), "default"),
        (lambda: ServerConfig(port=70000), "port must be"),
        (lambda: ServerConfig(tls_cert="c.pem"), "both --tls-cert and --tls-key"),
    ],
)
def test_config_errors_name_the_field(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_naive_config_is_the_write_ups_before():
    cfg = SloserveConfig.naive(path="default")
    assert cfg.scheduler.policy == "fifo"
    assert cfg.scheduler.max_batch == 1
    assert not cfg.cache.prefix_cache
    assert not cfg.scheduler.chunked_prefill


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_slo_must_be_positive_finite(value):
    with pytest.raises(InvalidRequestError, match="SLO ttft_s"):
        SLO(ttft_s=value)


def test_grpc_limits_become_grpc_core_options_and_off_means_left_out():
    options = dict(
        GrpcConfig(
            max_connection_age_s=0,
            max_connection_idle_s=60,
            max_streams_per_connection=8,
            max_connections=4,
            keepalive_time_s=30,
        ).channel_options()
    )
    assert "grpc.max_connection_age_ms" not in options  # 0: off, not "close at once"
    assert options["grpc.max_connection_idle_ms"] == 60_000
    assert options["grpc.max_concurrent_streams"] == 8
    assert options["grpc.max_allowed_incoming_connections"] == 4
    assert options["grpc.keepalive_time_ms"] == 30_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_streams", 0),
        ("stream_queue", -1),
        ("stream_stall_s", 0.0),
        ("stream_idle_s", -1.0),
        ("keepalive_time_s", float("nan")),
    ],
)
def test_grpc_limits_out_of_range_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        GrpcConfig(**{field: value})
