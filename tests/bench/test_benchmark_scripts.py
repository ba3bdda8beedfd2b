"""Smoke tests of benchmarks/goodput.py, seed_table.py and harness.py: their pure parts and arguments."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest
from sloserve.bench.client import LoadSpec
from sloserve.bench.stats import RequestRecord
from sloserve.bench.workloads import WorkloadItem
from sloserve.pb import serving_pb2 as pb
from sloserve.sampling_params import SLO

from benchmarks import _goodput_arms as ga
from benchmarks import frontend_load, goodput, harness, idle_spin, seed_table, stop_strings
from tests.bench.fake_server import FakeBehaviour, start_fake

INTERACTIVE = SLO(ttft_s=0.3, tpot_s=0.03, e2e_s=2.0)
BATCH = SLO(e2e_s=30.0)


# --- harness ------------------------------------------------------------------------------------


def test_overrides_are_checked_before_a_launch():
    assert harness.check_overrides(None) == {}
    ok = {
        "scheduler": {"policy": "fifo", "aging": 1.0, "max_wait_s": 1e9},
        "cache": {"prefix_cache": False},
    }
    assert harness.check_overrides(ok) == ok
    with pytest.raises(ValueError, match="section must be one of scheduler, cache, model, server"):
        harness.check_overrides({"parallel": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="server's address is the run's own"):
        harness.check_overrides({"server": {"port": 1}})
    with pytest.raises(ValueError, match="idle spin must be in"):
        harness.check_overrides({"server": {"idle_spin_s": -1.0}})
    assert harness.check_overrides({"model": {"cpu_gemm": "blas"}}) == {
        "model": {"cpu_gemm": "blas"}
    }
    with pytest.raises(ValueError, match="cpu gemm must be"):
        harness.check_overrides({"model": {"cpu_gemm": "mkl"}})
    with pytest.raises(ValueError, match="model path is the run's own"):
        harness.check_overrides({"model": {"path": "x"}})
    with pytest.raises(ValueError, match="has no field no_such_switch"):
        harness.check_overrides({"scheduler": {"no_such_switch": True}})
    with pytest.raises(ValueError, match="aging must be in"):
        harness.check_overrides({"scheduler": {"aging": 2.0}})
    with pytest.raises(ValueError, match="has no field"):
        harness.launch("full", overrides={"cache": {"bogus": 1}})  # nothing launched


def test_launch_config_applies_overrides_on_top_of_the_mode():
    full = harness.launch_config(
        "full",
        "default",
        1234,
        {"scheduler": {"policy": "fifo", "aging": 1.0}, "cache": {"prefix_cache": False}},
    )
    assert (full.scheduler.policy, full.scheduler.aging, full.cache.prefix_cache) == (
        "fifo",
        1.0,
        False,
    )
    assert (
        full.scheduler.max_batch > 1
        and full.server.port == 1234
        and full.server.metrics_port is None
    )
    naive = harness.launch_config("naive", "default", 1, {"scheduler": {"max_batch": 4}})
    assert (
        naive.scheduler.max_batch == 4
        and naive.scheduler.policy == "fifo"
        and not naive.cache.prefix_cache
    )
    assert harness.launch_config("full", "default", 1).scheduler == type(full.scheduler)()
    asleep = harness.launch_config("full", "default", 1, {"server": {"idle_spin_s": 0.0}})
    assert (asleep.server.idle_spin_s, asleep.server.port) == (0.0, 1)
    blas = harness.launch_config("full", "default", 1, {"model": {"cpu_gemm": "blas"}})
    assert (blas.model.path, blas.model.cpu_gemm) == ("default", "blas")


def test_every_arm_and_ablation_names_real_config_fields():
    """A switch the config lacks would only fail an hour into a full run."""
    for _, overrides in ga.ARMS.values():
        harness.check_overrides(overrides)
    for overrides in ga.ABLATIONS.values():
        harness.check_overrides(overrides)


def test_take_wraps_around_the_pool():
    pool = [WorkloadItem(str(i), 1) for i in range(5)]
    assert [i.prompt for i in harness.take(pool, 3, 4)] == ["3", "4", "0", "1"]


def test_arc_pool_caps_prompts_and_answer_lengths():
    spec, pool = harness.arc_pool(0, 300, 16, "synthetic-arc")
    assert spec == "synthetic-arc" and pool
    assert all(len(i.prompt) <= 300 and 1 <= i.max_tokens <= 16 for i in pool)
    assert len({i.prompt for i in pool}) > 1
    _, items = harness.arc_items(len(pool) + 3, 0, 300, 16, "synthetic-arc")
    assert items[len(pool) :] == pool[:3]


def test_message_dict_reads_fields_this_build_has():
    info = pb.InfoResponse(
        model="m", block_size=16, stats=pb.EngineStats(running=3, refusals={"ttft": 2})
    )
    out = harness.message_dict(info)
    assert (
        out["model"] == "m" and out["block_size"] == 16 and out["state"].startswith("SERVER_STATE_")
    )
    assert out["stats"]["running"] == 3 and out["stats"]["refusals"] == {"ttft": 2}
    assert out.get("no_such_field") is None


async def test_engine_info_and_sampled_send_against_the_fake_server():
    server, target = await start_fake(FakeBehaviour())
    try:
        info = await harness.engine_info(target)
        assert info["model"] == "fake" and "stats" in info
        items = [WorkloadItem(f"prompt {i}", 4) for i in range(6)]
        result, peaks = await harness.send_sampled(
            target, items, LoadSpec(concurrency=3), every_s=0.01
        )
        assert len(result.records) == 6 and all(r.status == "ok" for r in result.records)
        assert peaks.samples >= 1 and peaks.running == 0  # the fake reports no engine counters
    finally:
        await server.stop(0)


# --- goodput ------------------------------------------------------------------------------------


def test_goodput_defaults_are_the_issues_workload():
    a = goodput.parse_args([])
    assert (a.interactive_share, a.ttft, a.tpot, a.e2e, a.batch_e2e) == (0.3, 0.3, 0.03, 2.0, 30.0)
    assert a.arms == ["slo", "priority", "fifo", "naive"] and a.multiples == [
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
    ]
    assert a.requests == 200 and a.seeds == [0, 1, 2] and a.concurrency == 32 and a.ablation
    assert a.request_timeout == 60.0
    a = goodput.parse_args(
        ["--arms", "slo,fifo", "--multiples", "1", "--seeds", "0", "--no-ablation"]
    )
    assert a.arms == ["slo", "fifo"] and a.multiples == [1.0] and a.seeds == [0] and not a.ablation
    # a full run's 2x point
    assert a.points is None and goodput.parse_args(["--points", "3"]).points == [3]


BAD_ARGUMENTS = [
    (goodput, argv)
    for argv in (
        ["--arms", "slo,lifo"],
        ["--multiples", "0,1"],
        ["--interactive-share", "1.5"],
        ["--requests", "0"],
        ["--capacity", "-1"],
        ["--points", "5"],
        ["--multiples", "1,2", "--points", "2"],
    )
]
BAD_ARGUMENTS += [
    (idle_spin, argv)
    for argv in (["--spin", "0"], ["--rounds", "0"], ["--gaps", "-1"], ["--per-gap", "0"])
]
BAD_ARGUMENTS += [
    (stop_strings, argv) for argv in (["--stops", "0"], ["--stop-chars", "0"], ["--rounds", "0"])
]
BAD_ARGUMENTS += [
    (frontend_load, argv)
    for argv in (["--arms", "1,many"], ["--arms", "0"], ["--clients", "0"], ["--seconds", "0"])
]


@pytest.mark.parametrize(
    ("script", "argv"), BAD_ARGUMENTS, ids=[f"{m.__name__} {' '.join(a)}" for m, a in BAD_ARGUMENTS]
)
def test_scripts_reject_bad_arguments(script, argv, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_the_hostile_stop_strings_are_distinct_and_as_long_as_asked():
    stops = stop_strings.hostile_stops(300, 12)
    assert len(set(stops)) == 300 and {len(s) for s in stops} == {12}
    assert frontend_load.parse_args(["--arms", "1,4,thread"]).arm_list == ["1", "4", "thread"]


def test_classes_are_an_exact_seeded_share():
    labels = ga.classes_of(200, 0.3, 7)
    assert labels.count("interactive") == 60 and labels == ga.classes_of(200, 0.3, 7)
    assert labels != ga.classes_of(200, 0.3, 8)
    items = ga.mix(
        [WorkloadItem("p", 5)] * 3, ["interactive", "batch", "batch"], INTERACTIVE, BATCH
    )
    assert [i.slo for i in items] == [INTERACTIVE, BATCH, BATCH]
    if "priority" in ga.ITEM_FIELDS:
        assert [(i.slo_class, i.priority) for i in items] == [
            ("interactive", 0),
            ("batch", 1),
            ("batch", 1),
        ]


def test_class_figures_from_the_records_when_summarise_has_none():
    def rec(i: int, slo: SLO, e2e: float, status: str = "ok") -> RequestRecord:
        r = RequestRecord(
            f"bench-{i}",
            0.0,
            slo=slo,
            chunk_times=[0.1, e2e],
            chunk_tokens=[1, 1],
            end_time=e2e,
            status=status,
        )
        r.output_tokens = 2
        return r

    records = [
        rec(0, INTERACTIVE, 0.12),
        rec(1, INTERACTIVE, 3.0),
        rec(2, BATCH, 20.0),
        rec(3, BATCH, 0.0, "refused"),
    ]
    labels = ["interactive", "interactive", "batch", "batch"]
    out = ga.class_figures({"duration_s": 10.0}, records, labels)
    assert out["interactive"]["slo_attainment"] == 0.5 and out["interactive"]["goodput"] == 0.1
    assert out["batch"]["slo_attainment"] == 0.5 and out["batch"]["refused"] == 1


def pt(
    arm: str,
    m: float,
    seed: int,
    goodput: float,
    attainment: float = 1.0,
    interactive: float = 1.0,
    refused: int = 0,
) -> dict:
    return {
        "arm": arm,
        "multiple": m,
        "seed": seed,
        "goodput": goodput,
        "attainment": attainment,
        "interactive": interactive,
        "batch": 1.0,
        "refused": refused,
        "failed": 0,
    }


def test_aggregate_takes_median_and_range_over_seeds():
    agg = ga.aggregate([pt("slo", 1.0, s, g) for s, g in enumerate([3.0, 1.0, 2.0])], "arm")
    assert agg[("slo", 1.0)]["goodput"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert ga.cell(agg[("slo", 1.0)]["goodput"], digits=1) == "2.0 [1.0-3.0]"
    assert ga.median_range([None, None]) is None and ga.cell(None) == "n/a"


def test_engine_work_from_a_fresh_servers_counters():
    stats = {
        "steps_total": 400,
        "busy_seconds_total": 6.0,
        "computed_prompt_tokens_total": 50_000,
        "prefix_hit_tokens_total": 20_000,
        "generated_tokens_total": 9_000,
        "preemptions_total": 3,
    }
    work = ga.engine_work(stats, completed=120)
    assert work == {
        "steps": 400,
        "busy_s": 6.0,
        "step_ms": 15.0,
        "busy_ms_per_request": 50.0,
        "prompt_computed": 50_000,
        "prefix_hits": 20_000,
        "generated": 9_000,
        "preemptions": 3,
    }
    assert ga.engine_work({}, completed=0)["step_ms"] is None  # a build without the counters
    assert ga.engine_work(stats, completed=0)["busy_ms_per_request"] is None  # nothing served
    agg = ga.aggregate([pt("slo", 2.0, 0, 10.0) | work, pt("slo", 2.0, 1, 12.0)], "arm")
    assert agg[("slo", 2.0)]["steps"] == {"median": 400, "min": 400, "max": 400, "n": 1}


def test_goals_pass_fail_and_not_measured():
    points = [
        pt("slo", 1.0, 0, 10.0),
        pt("slo", 1.5, 0, 15.0, interactive=0.97),
        pt("fifo", 1.5, 0, 9.0),
        pt("priority", 1.5, 0, 13.0),
        pt("slo", 3.0, 0, 13.0),
        pt("slo", 0.5, 0, 5.0, refused=1),
    ]
    verdicts = {
        text: ok for text, ok, _ in ga.goals(ga.aggregate(points, "arm"), [0.5, 1.0, 1.5, 3.0])
    }
    assert verdicts["1.5x: slo goodput >= 1.5x fifo"] is True
    assert verdicts["1.5x: slo goodput >= 1.2x priority"] is False  # 15 < 1.2 * 13
    assert verdicts["1.5x: slo interactive attainment >= 95%"] is True
    assert verdicts["2x: slo goodput >= 1.5x fifo"] is None
    assert verdicts["0.5x: slo refuses nothing (most over seeds)"] is False
    assert verdicts["1x: slo refuses nothing (most over seeds)"] is True
    assert verdicts["3x: slo goodput >= 90% of its best point"] is False  # 13 < 0.9 * 15


def test_estimates_and_steady_throughput():
    base = ga.estimate_s(200, 10.0, [0.5, 1, 1.5, 2, 3], ["slo", "fifo"], 3, 8, 1.5, 60.0)
    assert base > 3 * 2 * 200 * (2 + 1 + 1 / 1.5 + 0.5 + 1 / 3) / 10.0  # at least the arrivals
    assert (
        ga.estimate_s(200, 10.0, [0.5, 1, 1.5, 2, 3], ["slo", "fifo", "naive"], 3, 8, 1.5, 60.0)
        > base
    )
    records = [
        RequestRecord(f"bench-{i}", i + 1.0, end_time=i + 3.0, status="ok") for i in range(10)
    ]
    assert ga.steady_throughput(records) == pytest.approx(7 / 7)  # ends 3..10 s, sends until 10 s
    assert ga.steady_throughput(records[:1]) is None
    # naive's unloaded capacity here: ~22 req/s
    assert seed_table.estimate_s(100, 22.0, 3, 200.0) < 15 * 60


# --- seed_table ---------------------------------------------------------------------------------


def test_seed_table_defaults_follow_the_issue():
    a = seed_table.parse_args([])
    assert a.requests_per_rate >= 100 and a.seeds == [0, 1, 2] and a.max_tokens >= 64


def test_ratio_rows_judge_the_write_up_goals():
    mr = lambda v: {"median": v, "min": v, "max": v, "n": 1}  # noqa: E731
    row = seed_table.ratio_row("qps", mr(1.0), mr(4.0), 1, 2, 3.16, True, "")
    assert row[3] == "x4.00" and row[4].endswith("PASS")
    assert seed_table.ratio_row("p99", mr(100.0), mr(50.0), 1, 0, 0.34, False, "")[4].endswith(
        "FAIL"
    )
    assert seed_table.ratio_row("qps", None, mr(4.0), 1, 2, 3.16, True, "")[4].endswith("n/a")
    # full never fell below 95%: its QPS is a lower bound, so a pass holds and a fail is inconclusive
    never_missed = lambda v: seed_table.bounded_median([(v, math.inf)])  # noqa: E731
    assert seed_table.ratio_row("qps", mr(1.0), never_missed(4.0), 1, 2, 3.16, True, "")[
        4
    ].endswith("PASS")
    lower = seed_table.ratio_row("qps", mr(1.0), never_missed(2.0), 1, 2, 3.16, True, "")
    assert (
        lower[4].endswith("n/a (not crossed)") and lower[2] == ">= 2.00" and lower[3] == ">= x2.00"
    )
    # naive never met 95%: its QPS is below its lowest rate, so the ratio is a lower bound again
    never_met = seed_table.bounded_median([(0.0, 1.55)])
    row = seed_table.ratio_row("qps", never_met, mr(6.35), 1, 2, 3.16, True, "")
    assert row[1] == "<= 1.55" and row[3] == ">= x4.10" and row[4].endswith("PASS")
    assert seed_table.ratio_row("qps", never_met, mr(3.0), 1, 2, 3.16, True, "")[4].endswith(
        "n/a (not crossed)"
    )
    assert (
        seed_table.ratio_row("qps", never_met, never_missed(9.0), 1, 2, 3.16, True, "")[3]
        == ">= x5.81"
    )


def test_qps_bounds_follow_what_each_sweep_crossed():
    run = lambda rate, att: {"rate": rate, "slo_attainment": att}  # noqa: E731
    # interpolated
    assert seed_table.qps_bounds([run(1.0, 0.99), run(2.0, 0.91)]) == pytest.approx((1.5, 1.5))
    assert seed_table.qps_bounds([run(1.0, 0.99), run(2.0, 0.97)]) == (
        2.0,
        math.inf,
    )  # never missed
    assert seed_table.qps_bounds([run(1.55, 0.84), run(2.48, 0.72)]) == (0.0, 1.55)  # never met
    # the median of three seeds is bounded by the medians of their lows and of their highs
    fig = seed_table.bounded_median([(0.0, 1.55), (1.55, 1.55), (0.0, 1.62)])
    assert (fig["low"], fig["high"], fig["median"]) == (0.0, 1.55, 1.55)
    # one seed's bound, still exact
    fig = seed_table.bounded_median([(0.0, 1.62), (4.28, 4.28), (1.82, 1.82)])
    assert fig["low"] == fig["high"] == fig["median"] == 1.82 and fig["min"] == 1.62


def test_seed_table_reports_a_saved_run(tmp_path):
    """--report rebuilds the table from the JSON a run saved (seeds become string keys there)."""
    run = lambda rate, att: {"rate": rate, "slo_attainment": att}  # noqa: E731
    peak = {
        "paged_bytes": 2**20,
        "contiguous_bytes": 2**25,
        "rss_bytes": 2**29,
        "running": 4,
        "source": "kv_blocks_peak",
    }
    payload = {
        "args": {"seeds": [0, 1], "requests_per_rate": 100},
        "slo": {"ttft_s": 0.2, "tpot_s": None, "e2e_s": 30.0},
        "common_rate": 1.5,
        "write_up": seed_table.WRITE_UP,
        "sweeps": {
            "naive": {"0": [run(1.5, 0.9)], "1": [run(1.5, 0.96), run(2.4, 0.8)]},
            "full": {"0": [run(4.0, 0.99), run(6.4, 0.9)], "1": [run(4.0, 0.97), run(6.4, 0.93)]},
        },
        "peaks": {m: {"0": peak, "1": peak} for m in seed_table.MODES},
        "p99_e2e_s": {"naive": {"0": 1.0, "1": 1.2}, "full": {"0": 0.3, "1": 0.4}},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(payload))
    text = seed_table.report(json.loads(path.read_text()))
    assert "naive seed 0: QPS@95 < 1.500" in text and "naive seed 1: QPS@95 1.556" in text
    # two seeds: the median is between the mean of the lows (0, 1.556) and of the highs (1.5, 1.556)
    qps_row = next(line for line in text.splitlines() if line.startswith("QPS at 95%"))
    assert "0.78-1.53" in qps_row and "x3.36-x6.60" in qps_row and "PASS" in qps_row
    assert seed_table.main(["--report", str(path)]) == 0


class _FakeServed:
    """seed_table's Served with attainment falling with the rate: >= 95% up to `meets_up_to` req/s."""

    def __init__(self, meets_up_to: float) -> None:
        self.meets_up_to, self.args, self.closed = (
            meets_up_to,
            argparse.Namespace(requests_per_rate=10),
            0,
        )

    def run(self, rate, slo, index):
        return {
            "rate": rate,
            "slo_attainment": 0.99 if rate <= self.meets_up_to else 0.5,
            "refused": 0,
            "e2e_s": {"p99": 0.1},
            "duration_s": 0.0,
        }

    def close(self):
        self.closed += 1


def test_seed_table_sweeps_up_to_the_crossing_and_down_below_the_grid_when_the_first_rate_misses():
    rates = seed_table.ladder(10.0)
    assert (
        rates == sorted(rates)
        and rates[seed_table.LOWER_RUNGS] == 5.0
        and rates[0] == pytest.approx(5 / 1.6**6, abs=1e-3)
    )
    first = seed_table.LOWER_RUNGS
    up = seed_table.sweep(_FakeServed(meets_up_to=20.0), rates, None, first, 1e9)
    assert [r["rate"] for r in up] == [5.0, 8.0, 12.5, 20.0, 32.0]  # up to the first miss
    # a server that misses at half its capacity: rungs below the grid, each on a fresh server, until one meets
    fake = _FakeServed(meets_up_to=1.0)
    down = seed_table.sweep(fake, rates, None, first, 1e9)
    assert [r["rate"] for r in down] == [
        rates[first - 4],
        rates[first - 3],
        rates[first - 2],
        rates[first - 1],
        5.0,
    ]
    assert down[0]["rate"] <= 1.0 < down[1]["rate"] and fake.closed == 4


# --- idle_spin ----------------------------------------------------------------------------------


def test_idle_spin_compares_the_default_window_with_none():
    a = idle_spin.parse_args([])
    assert (
        a.spin == harness.ServerConfig().idle_spin_s > 0 and 0.0 in a.gaps and max(a.gaps) > a.spin
    )


def test_idle_spin_sends_distinct_prompts_and_reads_cpu_time():
    items = idle_spin.distinct_prompts(20, 600, 8)
    assert len({i.prompt for i in items}) == 20 and all(i.max_tokens <= 8 for i in items)
    with pytest.raises(SystemExit, match="distinct prompts"):
        idle_spin.distinct_prompts(10**6, 600, 8)
    before = idle_spin.cpu_seconds([os.getpid()])
    sum(i * i for i in range(3 * 10**6))
    assert idle_spin.cpu_seconds([os.getpid()]) > before >= 0
    assert idle_spin.cpu_seconds([2**22 + 12345]) == 0.0  # a process that is gone counts nothing
