"""Resident weight bytes: each weight counted once, in the form its kernel reads; what the runner
reports, `sloserve info`, InfoResponse and the Prometheus gauge say the same number."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from sloserve.cli.main import cli
from sloserve.engine.outputs import EngineStats
from sloserve.frontend.frontend import ServerState
from sloserve.frontend.metrics import Metrics
from sloserve.grpc.convert import info_pb


def stored_bytes(folder, dtype: torch.dtype | None = None) -> int:
    """Bytes of every tensor in the checkpoint, in `dtype` (default: as stored)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        for t in load_file(file).values():
            total += t.numel() * (dtype or t.dtype).itemsize
    return total


def test_plain_float32_weights_count_as_the_checkpoint(make_runner, tiny_llama):
    runner = make_runner(tiny_llama, cpu_gemm="blas")
    assert runner.info()["weight_resident_bytes"] == stored_bytes(tiny_llama)


def test_partial_expert_residency_counts_host_copies_and_slots(make_runner, tiny_mixtral):
    """Two of four experts per layer resident: every expert's host copy plus the two slots."""
    runner = make_runner(tiny_mixtral, cpu_gemm="blas", expert_slots_per_layer=2)
    held = runner.info()["weight_resident_bytes"]
    slots = runner.experts.device_bytes
    assert slots > 0 and held == stored_bytes(tiny_mixtral) + slots


def test_local_info_json_reports_them(tiny_llama):
    args = ["info", "--model", str(tiny_llama), "--device", "cpu", "--json", "--cpu-gemm", "blas"]
    result = CliRunner().invoke(cli, [*args, "--kv-pool-size", "2MiB", "--block-size", "4"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert data["weight_resident_bytes"] == stored_bytes(tiny_llama)


def test_info_response_and_gauge_carry_them():
    info = {"max_model_len": 64, "weight_resident_bytes": 123456789}
    msg = info_pb(
        "m",
        info,
        EngineStats(),
        ServerState.SERVING,
        version="0",
        max_prompt_tokens=None,
        max_tokens_limit=8,
    )
    assert msg.weight_resident_bytes == 123456789
    stats = EngineStats()
    registry = Metrics(lambda: stats, engine_info=lambda: info, model_name="m").registry
    value = registry.get_sample_value("sloserve_weight_resident_bytes", {"model_name": "m"})
    assert value == 123456789
    loading = Metrics(lambda: stats, engine_info=dict, model_name="m").registry
    assert loading.get_sample_value("sloserve_weight_resident_bytes", {"model_name": "m"}) is None
