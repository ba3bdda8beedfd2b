"""`sloserve bench compare`: fresh servers per policy and load, identical arrivals, rotating order,
one JSON and one PNG (against fake servers, and once end to end on the built-in model)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
from click.testing import CliRunner
from sloserve.bench.compare import CompareSettings, Comparison, Load, parse_loads
from sloserve.bench.compare_report import format_compare, write_compare_plot
from sloserve.bench.plan import WorkloadPlan
from sloserve.bench.slo_rules import parse_rule
from sloserve.cli.bench import bench

from tests.bench.fake_server import FakeBehaviour, FakeThread

CLI = [sys.executable, "-c", "from sloserve.cli.main import cli; cli()"]


def test_loads_parse_as_multiples_or_rates():
    assert parse_loads("0.5x, 2x,3") == [Load(0.5, True), Load(2.0, True), Load(3.0, False)]
    assert Load(1.5, True).rate(4.0) == 6.0 and Load(3.0, False).rate(None) == 3.0
    for bad in ("0x", "x", "fast", "1,,2"):
        with pytest.raises(ValueError, match="--rates"):
            parse_loads(bad)


def test_each_policy_gets_a_fresh_server_and_the_same_arrivals(tmp_path):
    started: list[tuple[str, str, FakeThread]] = []

    def start(policy: str, label: str) -> FakeThread:
        fake = FakeThread(FakeBehaviour(ttft_s=0.001, token_s=0.0005))
        started.append((policy, label, fake))
        return fake

    rules = (
        parse_rule("gen>250:e2e=30,class=batch"),
        parse_rule("default:ttft=5,class=interactive"),
    )
    plan = WorkloadPlan("trace:azure-conv", num_requests=12, length_scale=0.02, rules=rules)
    settings = CompareSettings(
        ("slo", "priority", "fifo"),
        "fake",
        tuple(parse_loads("1x,2x")),
        plan,
        concurrency=4,
        capacity_requests=8,
    )
    lines: list[str] = []
    report = Comparison(settings, start_server=start, log=lines.append).run()
    assert [(p, label) for p, label, _ in started] == [
        ("slo", "capacity"),
        ("slo", "slo_1x"),
        ("priority", "priority_1x"),
        ("fifo", "fifo_1x"),
        ("priority", "priority_2x"),
        ("fifo", "fifo_2x"),
        ("slo", "slo_2x"),
    ]  # the order rotates per load
    sent = {}
    for _, label, fake in started[1:]:
        sent[label] = [
            (r.text, r.max_tokens) for r in sorted(fake.behaviour.seen, key=lambda r: r.request_id)
        ]
        assert len(sent[label]) == 12
    assert sent["slo_1x"] == sent["fifo_1x"] == sent["priority_2x"]  # identical requests everywhere
    assert report["capacity_measured"] and report["capacity_rps"] > 0
    assert len(report["points"]) == 6 and {p["attainment"] for p in report["points"]} == {1.0}
    assert all(
        p["interactive_attainment"] == 1.0 and p["run"]["vllm"]["completed"] == 12
        for p in report["points"]
    )
    two = [p for p in report["points"] if p["load"] == "2x"]
    assert all(p["rate"] == pytest.approx(2 * report["capacity_rps"]) for p in two)
    # met at every load
    assert report["goodput_rps"]["slo"] == pytest.approx(2 * report["capacity_rps"])
    assert lines[0].startswith("capacity:") and len(lines) == 7
    text = format_compare(report)
    assert "interactive %" in text and "goodput (highest rate with >= 90% attainment" in text
    write_compare_plot(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "slo,lifo"], "--policies: unknown lifo"),
        (["--policies", "slo,slo"], "distinct policies"),
        (["--rates", "1z"], "--rates: cannot read '1z'"),
        (["--capacity", "-1"], "--capacity must be > 0"),
        (
            ["--workload", "trace:azure-conv", "--time-scale", "2"],
            "--time-scale does not apply to compare",
        ),
        (["--workload", "trace:missing"], "is not a file nor one of the named samples"),
    ],
)
def test_bad_compare_input_is_one_line(args, message):
    result = CliRunner().invoke(bench, ["compare", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compare_end_to_end_on_the_built_in_model(tmp_path):
    """Three real servers (capacity, slo, fifo) on a few short trace requests."""
    done = subprocess.run(
        [
            *CLI,
            "bench",
            "compare",
            "--policies",
            "slo,fifo",
            "--rates",
            "1x",
            "--workload",
            "trace:azure-conv",
            "--num-requests",
            "6",
            "--length-scale",
            "0.03",
            "--capacity-requests",
            "6",
            "--concurrency",
            "3",
            "--slo-rule",
            "default:ttft=5,e2e=30,class=interactive",
            "--json",
            str(tmp_path / "c.json"),
            "--plot",
            str(tmp_path / "c.png"),
        ],
        capture_output=True,
        text=True,
        timeout=290,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = orjson.loads((tmp_path / "c.json").read_bytes())
    assert [p["policy"] for p in report["points"]] == ["slo", "fifo"]
    assert all(p["completed"] == 6 and p["failed"] == 0 for p in report["points"])
    assert report["server_info"]["max_model_len"] > 0 and "capacity" in done.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
