"""Per-class reporting: class names, JSONL `class` / `priority`, per-class figures and table."""

from __future__ import annotations

import json

import pytest
from sloserve.bench import http_client
from sloserve.bench.client import LoadSpec, build_request, connect, run_load
from sloserve.bench.report import format_class_table, format_table
from sloserve.bench.stats import RequestRecord, missed_objectives, slo_class_name, summarise
from sloserve.bench.workloads import WorkloadItem, load_workload
from sloserve.sampling_params import SLO

from tests.bench.fake_server import FakeBehaviour, start_fake

INTERACTIVE = SLO(ttft_s=0.3, tpot_s=0.03, e2e_s=2.0)
BATCH = SLO(e2e_s=30.0)


def record(ttft: float, e2e: float, tokens: int = 3, status: str = "ok", **kw) -> RequestRecord:
    """A request sent at 0 whose first chunk came at ttft and the rest at e2e."""
    chunks = [ttft, e2e] if status == "ok" else []
    r = RequestRecord(
        "r",
        0.0,
        chunk_times=chunks,
        chunk_tokens=[1, tokens - 1][: len(chunks)],
        end_time=e2e,
        status=status,
        **kw,
    )
    r.output_tokens = tokens if status == "ok" else 0
    return r


@pytest.mark.parametrize(
    "slo, name",
    [
        (None, "no objective"),
        (SLO(), "no objective"),
        (INTERACTIVE, "ttft<=0.3s tpot<=30ms e2e<=2s"),
        (BATCH, "e2e<=30s"),
        (SLO(ttft_s=0.5, e2e_s=3.0), "ttft<=0.5s e2e<=3s"),
        (SLO(tpot_s=0.0025), "tpot<=2.5ms"),
    ],
)
def test_class_names_derive_from_objectives(slo, name):
    assert slo_class_name(slo) == name


def test_summarise_groups_mixed_classes():
    fast = record(0.1, 0.15, slo=INTERACTIVE)  # TPOT 25 ms: met
    late = record(0.5, 0.6, slo=INTERACTIVE)  # TTFT 0.5 s: missed
    refused = record(0.0, 0.01, status="refused", slo=INTERACTIVE)
    batch_ok = record(1.0, 10.0, slo=BATCH)
    batch_failed = record(0.0, 5.0, status="failed", slo=BATCH)
    out = summarise([fast, late, refused, batch_ok, batch_failed], 4.0, None, 1.0)
    assert out["slo_attainment"] == pytest.approx(2 / 5)  # the run's figures are unchanged
    interactive, batch = out["classes"]["ttft<=0.3s tpot<=30ms e2e<=2s"], out["classes"]["e2e<=30s"]
    assert list(out["classes"]) == ["e2e<=30s", "ttft<=0.3s tpot<=30ms e2e<=2s"]  # sorted by name
    assert (
        interactive["requests"],
        interactive["completed"],
        interactive["refused"],
        interactive["failed"],
    ) == (3, 2, 1, 0)
    assert interactive["slo_attainment"] == pytest.approx(1 / 3)
    assert interactive["goodput"] == pytest.approx(1 / 4.0)  # met per second of the whole run
    assert interactive["ttft_s"]["mean"] == pytest.approx(0.3)
    assert interactive["tpot_s"]["p50"] == pytest.approx((0.025 + 0.05) / 2)
    assert interactive["e2e_s"]["p90"] == pytest.approx(0.15 + 0.9 * 0.45)
    assert (batch["requests"], batch["completed"], batch["failed"]) == (2, 1, 1)
    assert batch["slo_attainment"] == pytest.approx(0.5) and batch["goodput"] == pytest.approx(0.25)
    assert set(batch) == {
        "requests",
        "completed",
        "refused",
        "failed",
        "slo_attainment",
        "goodput",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "missed",
    }
    assert interactive["missed"] == {
        "ttft": 1,
        "tpot": 1,
        "e2e": 0,
    }  # completed ones only (late: TPOT 50 ms)
    assert batch["missed"] == {"ttft": 0, "tpot": 0, "e2e": 0}


def test_missed_objectives_names_each_objective_missed():
    assert missed_objectives(record(0.1, 0.15), INTERACTIVE) == []
    assert missed_objectives(record(0.5, 3.0, tokens=11), INTERACTIVE) == [
        "ttft",
        "tpot",
        "e2e",
    ]  # TPOT 250 ms
    assert missed_objectives(record(0.1, 2.5, tokens=100), INTERACTIVE) == ["e2e"]  # TPOT 24.2 ms
    assert missed_objectives(record(0.0, 0.1, status="refused"), BATCH) == ["e2e"]
    assert missed_objectives(record(0.1, 99.0), None) == []


def test_summarise_explicit_class_and_run_objectives():
    tagged = record(0.1, 0.15, slo=INTERACTIVE, slo_class="interactive")
    untagged = record(0.1, 0.2)  # no objective of its own: the run's names its class
    out = summarise([tagged, untagged], 1.0, SLO(ttft_s=2.0), None)
    assert set(out["classes"]) == {"interactive", "ttft<=2s"}
    assert out["classes"]["interactive"]["slo_attainment"] == 1.0
    nothing = summarise([record(0.1, 0.2)], 1.0, None, None)
    assert list(nothing["classes"]) == ["no objective"]
    assert summarise([], 0.0, None, None)["classes"] == {}


def test_class_table_only_with_more_than_one_class():
    one = summarise([record(0.1, 0.2), record(0.1, 0.3)], 1.0, BATCH, 1.0)
    assert format_class_table([one]) == ""
    assert "SLO class" not in format_table([one])
    two = summarise(
        [
            record(0.1, 0.2, slo_class="interactive"),
            record(0.1, 0.3, slo_class="batch"),
            record(0.0, 0.1, status="refused", slo_class="batch"),
        ],
        2.0,
        BATCH,
        2.0,
    )
    table = format_table([one, two])
    run_part, class_part = table.split("SLO class", 1)
    assert "SLO attainment %" in run_part
    rows = [line.split() for line in class_part.splitlines() if line.startswith("2/s")]
    assert [row[1] for row in rows] == ["batch", "interactive"]
    batch = rows[0]
    assert batch[2:7] == ["1/2", "1", "0", "50.0", "0.50"]
    assert batch[7] == "100.0/100.0"  # TTFT p50/p90 in ms


def test_jsonl_class_and_priority(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(line)
            for line in [
                {"prompt": "a", "class": "interactive", "priority": 0, "slo": {"ttft_s": 0.3}},
                {"prompt": "b", "class": "batch", "priority": -3},
                {"prompt": "c"},
            ]
        )
    )
    items = {i.prompt: i for i in load_workload(f"jsonl:{path}")}
    assert (items["a"].slo_class, items["a"].priority) == ("interactive", 0)
    assert (items["b"].slo_class, items["b"].priority) == ("batch", -3)
    assert (items["c"].slo_class, items["c"].priority) == (None, None)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"class": ""}, "'class' must be a non-empty string"),
        ({"class": "  "}, "'class' must be a non-empty string"),
        ({"class": 3}, "'class' must be a non-empty string"),
        ({"priority": "high"}, "'priority' must be an integer"),
        ({"priority": 1.5}, "'priority' must be an integer"),
        ({"priority": True}, "'priority' must be an integer"),
        ({"priority": 2**31}, "'priority' must be an integer in [-2147483648, 2147483647]"),
    ],
)
def test_jsonl_class_and_priority_errors(tmp_path, fields, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "p", **fields}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: ") as info:
        load_workload(f"jsonl:{path}")
    assert message in str(info.value)


def test_priority_is_sent_only_when_set():
    spec = LoadSpec()
    plain = build_request("r", WorkloadItem("p", 4), spec, None)
    assert not plain.HasField("priority")
    urgent = build_request("r", WorkloadItem("p", 4, priority=-2), spec, None)
    assert urgent.HasField("priority") and urgent.priority == -2
    _, body, _ = http_client.build_request("r", WorkloadItem("p", 4), spec, None)
    assert "priority" not in body
    _, body, _ = http_client.build_request("r", WorkloadItem("p", 4, priority=0), spec, None)
    assert body["priority"] == 0


async def test_driver_sets_each_record_class():
    server, target = await start_fake(FakeBehaviour())
    channel = await connect(target)
    try:
        items = [
            WorkloadItem("a", 2, slo=INTERACTIVE),
            WorkloadItem("b", 2),
            WorkloadItem("c", 2, slo=INTERACTIVE, slo_class="chat"),
        ]
        result = await run_load(channel, items, LoadSpec(slo=BATCH))
    finally:
        await channel.close()
        await server.stop(0)
    assert [r.slo_class for r in result.records] == [
        "ttft<=0.3s tpot<=30ms e2e<=2s",
        "e2e<=30s",
        "chat",
    ]
    out = summarise(result.records, result.duration_s, BATCH, result.rate)
    assert {name: c["requests"] for name, c in out["classes"].items()} == {
        "chat": 1,
        "e2e<=30s": 1,
        "ttft<=0.3s tpot<=30ms e2e<=2s": 1,
    }
