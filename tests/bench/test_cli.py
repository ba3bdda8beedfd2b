"""`sloserve bench` end to end against the fake server (run in a thread): JSON, PNG, bad input."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner
from sloserve.cli.bench import bench

RUN_KEYS = {
    "rate",
    "completed",
    "refused",
    "duration_s",
    "request_throughput",
    "output_token_throughput",
    "prompt_tokens",
    "prefix_hit_tokens",
    "slo_attainment",
    "goodput",
    "ttft_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
}


def test_sweep_writes_json_and_png(fake_target, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    result = CliRunner().invoke(
        bench,
        [
            "--server",
            fake_target,
            "--workload",
            "synthetic-arc",
            "--num-requests",
            "8",
            "--max-tokens",
            "5",
            "--rate",
            "50,200",
            "--streams",
            "2",
            "--slo-ttft",
            "5",
            "--slo-e2e",
            "30",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "SLO attainment %" in result.output and "TTFT p99 (ms)" in result.output
    report = orjson.loads(out_json.read_bytes())
    assert report["schema_version"] == 1 and report["server_info"]["model"] == "fake"
    assert report["config"]["slo"] == {"ttft_s": 5.0, "tpot_s": None, "e2e_s": 30.0}
    assert [run["rate"] for run in report["runs"]] == [50.0, 200.0]
    for run in report["runs"]:
        assert RUN_KEYS <= run.keys()
        assert run["completed"] == 8 and run["refused"] == 0 and run["slo_attainment"] == 1.0
        assert run["exact_match"] == 0.0  # the fake answers x's
        assert run["output_tokens"] <= 5 * 8
        for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(run[metric]) == {"mean", "p50", "p90", "p99"}
            assert 0 < run[metric]["p50"] <= run[metric]["p99"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_loop_single_rate(fake_target, tmp_path):
    out_json = tmp_path / "c.json"
    result = CliRunner().invoke(
        bench,
        [
            "--server",
            fake_target,
            "--workload",
            "fixed:10,4",
            "--num-requests",
            "6",
            "--concurrency",
            "2",
            "--json",
            str(out_json),
        ],
    )
    assert result.exit_code == 0, result.output
    (run,) = orjson.loads(out_json.read_bytes())["runs"]
    assert run["rate"] is None and run["rate_label"] == "inf"
    assert run["completed"] == 6 and run["output_tokens"] == 24


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slo-tpot", "-1"], "--slo-tpot must be a number of seconds > 0"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--workload", "jsonl:/no/such/file.jsonl"], "cannot read JSONL workload"),
        (["--workload", "bogus"], "unknown workload"),
        (["--server", "127.0.0.1:1", "--connect-timeout", "0.5"], "cannot reach a sloserve server"),
        (["--concurrency", "0"], "concurrency must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--streams", "x"], "is not a valid integer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(bench, ["--workload", "fixed:4,2", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_per_class_table_and_json(fake_target, tmp_path):
    workload, out_json = tmp_path / "mixed.jsonl", tmp_path / "m.json"
    workload.write_text(
        "\n".join(
            orjson.dumps(line).decode()
            for line in [
                {
                    "prompt": "a",
                    "max_tokens": 3,
                    "class": "interactive",
                    "priority": 0,
                    "slo": {"ttft_s": 5},
                },
                {"prompt": "b", "max_tokens": 3, "priority": 1},
            ]
        )
    )
    result = CliRunner().invoke(
        bench,
        [
            "--server",
            fake_target,
            "--workload",
            f"jsonl:{workload}",
            "--num-requests",
            "6",
            "--slo-e2e",
            "30",
            "--json",
            str(out_json),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "SLO class" in result.output
        and "interactive" in result.output
        and "e2e<=30s" in result.output
    )
    (run,) = orjson.loads(out_json.read_bytes())["runs"]
    assert {name: c["requests"] for name, c in run["classes"].items()} == {
        "interactive": 3,
        "e2e<=30s": 3,
    }
    assert all(c["slo_attainment"] == 1.0 for c in run["classes"].values())


def test_one_class_prints_no_class_table(fake_target, tmp_path):
    out_json = tmp_path / "one.json"
    result = CliRunner().invoke(
        bench,
        [
            "--server",
            fake_target,
            "--workload",
            "fixed:4,2",
            "--num-requests",
            "3",
            "--json",
            str(out_json),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "SLO class" not in result.output
    (run,) = orjson.loads(out_json.read_bytes())["runs"]
    assert list(run["classes"]) == ["no objective"]


def test_a_file_workload_repeated_to_the_default_count_says_so(fake_target, tmp_path):
    """A 3-line JSONL under the default 200 requests is sent ~67 times over: the user is told, once."""
    path = tmp_path / "three.jsonl"
    path.write_text(
        "".join(
            orjson.dumps({"prompt": f"p{i}", "max_tokens": 2}).decode() + "\n" for i in range(3)
        )
    )
    noted = CliRunner().invoke(
        bench, ["--server", fake_target, "--workload", f"jsonl:{path}", "--concurrency", "8"]
    )
    assert noted.exit_code == 0, noted.output
    assert "holds 3 requests, so the default 200 repeat them" in noted.stderr
    assert "--num-requests 3 sends each once" in noted.stderr
    once = CliRunner().invoke(
        bench, ["--server", fake_target, "--workload", f"jsonl:{path}", "--num-requests", "3"]
    )
    assert once.exit_code == 0 and "repeat" not in once.stderr
