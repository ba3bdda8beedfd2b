"""`sloserve bench` with a trace, rules, the goodput search and vLLM's fields, against the fake server."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner
from sloserve.bench.stats import RequestRecord, summarise
from sloserve.cli.bench import bench
from sloserve.sampling_params import SLO

VLLM_FIELDS = {
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    *(
        f"{stat}_{metric}_ms"
        for stat in ("mean", "median", "std", "p99")
        for metric in ("ttft", "tpot", "itl", "e2el")
    ),
}


def test_trace_replay_with_rules_writes_vllm_fields(fake_target, tmp_path):
    out_json = tmp_path / "t.json"
    result = CliRunner().invoke(
        bench,
        [
            "--server",
            fake_target,
            "--workload",
            "trace:azure-conv",
            "--num-requests",
            "30",
            "--rate",
            "60",
            "--length-scale",
            "0.02",
            "--slo-rule",
            "prompt>1000:e2e=30,class=long",
            "--slo-rule",
            "default:ttft=5,class=short",
            "--json",
            str(out_json),
        ],
    )
    assert result.exit_code == 0, result.output
    report = orjson.loads(out_json.read_bytes())
    (run,) = report["runs"]
    assert run["completed"] == 30 and run["rate"] == 60.0
    assert set(run["classes"]) == {"long", "short"} and "SLO class" in result.output
    assert report["config"]["slo_rules"] == [
        "prompt>1000:e2e=30,class=long",
        "default:ttft=5,class=short",
    ]
    assert VLLM_FIELDS <= run["vllm"].keys()
    assert (
        run["vllm"]["completed"] == 30
        and run["vllm"]["request_throughput"] == run["request_throughput"]
    )
    assert run["vllm"]["total_output_tokens"] == run["output_tokens"]


def test_goodput_search_reports_its_bracket(fake_target, tmp_path):
    out_json = tmp_path / "s.json"
    result = CliRunner().invoke(
        bench,
        [
            "--server",
            fake_target,
            "--workload",
            "fixed:4,2",
            "--num-requests",
            "4",
            "--rate",
            "5,40",
            "--goodput-search",
            "--search-repeats",
            "1",
            "--search-tolerance",
            "0.5",
            "--slo-e2e",
            "30",
            "--json",
            str(out_json),
        ],
    )
    assert result.exit_code == 0, result.output
    found = orjson.loads(out_json.read_bytes())["goodput_search"]
    assert found["converged"] and found["bracket"][1] == 40.0 and found["attainment_target"] == 0.9
    assert 5.0 < found["rate"] < 40.0 and found["bracket"][0] == found["rate"]
    assert "goodput (90% attainment)" in result.output and "goodput search:" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "trace:azure-conv", "--rate", "2", "--time-scale", "2"], "not both"),
        (["--workload", "fixed:4,2", "--length-scale", "2"], "--length-scale applies to a trace"),
        (
            ["--workload", "trace:azure-conv", "--length-scale", "0"],
            "--length-scale must be a number > 0",
        ),
        (["--slo-rule", "gen>1"], "use CONDITION:SETTINGS"),
        (["--goodput-search", "--attainment", "2"], "--attainment must be in (0, 1]"),
        (["--goodput-search", "--rate", "1,2,3"], "--goodput-search takes --rate START"),
    ],
)
def test_bad_trace_and_search_input_is_one_line(args, message):
    result = CliRunner().invoke(
        bench, ["--server", "127.0.0.1:1", "--connect-timeout", "0.5", *args]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_vllm_fields_follow_vllms_definitions():
    """Two requests with exact timings: TTFT 100/300 ms, E2E 400/900 ms, 4 output tokens each."""
    records = []
    for k, (ttft, gaps) in enumerate(((0.1, (0.1, 0.1, 0.1)), (0.3, (0.2, 0.2, 0.2)))):
        r = RequestRecord(
            f"r{k}", 0.0, slo=SLO(ttft_s=0.2), status="ok", prompt_tokens=10, output_tokens=4
        )
        r.chunk_times = [ttft, ttft + gaps[0], ttft + sum(gaps[:2]), ttft + sum(gaps)]
        r.end_time = r.chunk_times[-1]
        records.append(r)
    v = summarise(records, 2.0, None, 1.0)["vllm"]
    assert v["mean_ttft_ms"] == pytest.approx(200) and v["median_ttft_ms"] == pytest.approx(200)
    assert v["std_ttft_ms"] == pytest.approx(100) and v["p99_ttft_ms"] == pytest.approx(298)
    assert v["mean_tpot_ms"] == pytest.approx(150) and v["mean_itl_ms"] == pytest.approx(150)
    assert v["mean_e2el_ms"] == pytest.approx(650)
    assert v["request_throughput"] == 1.0 and v["request_goodput"] == 0.5  # one met TTFT <= 200 ms
    assert v["output_throughput"] == 4.0 and v["total_token_throughput"] == 14.0
