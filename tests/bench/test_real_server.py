"""`sloserve bench` for a few seconds against a real `sloserve serve` on the default model."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
from sloserve.testing.ports import free_port
from sloserve.testing.server_process import ServerProcess

CLI = [sys.executable, "-c", "from sloserve.cli.main import cli; cli()"]


@pytest.fixture(scope="module")
def server():
    """A real server subprocess (default model, CPU); yields HOST:PORT once started."""
    port = free_port()
    server = ServerProcess(
        [
            "serve",
            "--model",
            "default",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--metrics-port",
            "off",
            "--http-port",
            "off",
            "--grace",
            "1",
        ],
        port=port,
    )
    yield server.target
    assert server.stop() == 0, "\n".join(server.raw[-40:])


@pytest.mark.timeout(170)
def test_bench_against_a_real_server(server, tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = subprocess.run(
        [
            *CLI,
            "bench",
            "--server",
            server,
            "--workload",
            "fixed:48,6",
            "--rate",
            "2,4",
            "--duration",
            "2",
            "--streams",
            "2",
            "--slo-ttft",
            "60",
            "--slo-tpot",
            "10",
            "--ignore-eos",
            "--ready-timeout",
            "120",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SLO attainment %" in done.stdout
    report = orjson.loads(out_json.read_bytes())
    assert report["server_info"]["model"] and report["server_info"]["device"] == "cpu"
    assert [run["rate"] for run in report["runs"]] == [2.0, 4.0]
    for run in report["runs"]:
        assert run["completed"] >= 1 and run["failed"] == 0
        assert run["output_tokens"] == 6 * run["completed"]  # --ignore-eos: exactly max_tokens each
        assert run["prompt_tokens"] >= run["completed"] > 0
        assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"] <= run["e2e_s"]["p99"]
        assert run["tpot_s"]["p50"] > 0 and run["itl_s"]["p99"] > 0
        assert 0.0 <= run["slo_attainment"] <= 1.0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
