"""`sloserve bench compare`: policies side by side, a fresh server per policy and load, one JSON and one PNG."""

from __future__ import annotations

from pathlib import Path

import click
from sloserve.bench.compare import CompareSettings, Comparison, parse_loads
from sloserve.bench.compare_report import format_compare, write_compare_plot
from sloserve.bench.report import write_json
from sloserve.cli.bench_common import (
    BenchInputError,
    OneLineCommand,
    Progress,
    report_path_option,
    workload_options,
)
from sloserve.config import POLICIES

DEFAULT_REQUESTS = 200  # per point, for a workload that is not a trace


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if bad := [p for p in names if p not in POLICIES]:
        raise BenchInputError(
            f"--policies: unknown {', '.join(bad)}; choose from {', '.join(POLICIES)}"
        )
    return names


@click.command("compare", cls=OneLineCommand)
@click.option(
    "--policies",
    default="slo,priority,fifo",
    show_default=True,
    help=f"Scheduling policies to compare ({', '.join(POLICIES)}).",
)
@click.option(
    "--model", default="default", show_default=True, help="The model every server serves."
)
@click.option(
    "--rates",
    default="0.5x,1x,1.5x,2x",
    show_default=True,
    help="Loads: multiples of the measured capacity (1.5x) or requests/s (3).",
)
@workload_options
@click.option(
    "--num-requests",
    type=int,
    default=None,
    help=f"Requests per point [default: a trace's length, else {DEFAULT_REQUESTS}].",
)
@click.option(
    "--capacity", type=float, default=None, help="Capacity in req/s: skip its measurement."
)
@click.option(
    "--concurrency",
    default=32,
    show_default=True,
    type=int,
    help="Closed loop of the capacity run.",
)
@click.option(
    "--capacity-requests",
    default=100,
    show_default=True,
    type=int,
    help="Requests of the capacity run.",
)
@click.option(
    "--streams", default=4, show_default=True, type=int, help="Bidirectional streams per run."
)
@click.option(
    "--request-timeout",
    default=120.0,
    show_default=True,
    type=float,
    help="Cancel and count as missed a request open this long (s); bounds an overloaded point.",
)
@click.option(
    "--attainment",
    default=0.9,
    show_default=True,
    type=float,
    help="Attainment that defines goodput (the highest rate meeting it).",
)
@click.option(
    "--interactive-class",
    default="interactive",
    show_default=True,
    help="The class plotted apart (else: requests with a TTFT objective).",
)
@click.option(
    "--serve-arg",
    "serve_args",
    multiple=True,
    help="A flag for every `sloserve serve`, e.g. --serve-arg=--max-batch=32 (repeatable).",
)
@click.option(
    "--ready-timeout",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds to wait for each server's model to load.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep each server's log here [default: discarded].",
)
@report_path_option("--json", "json_path", default="compare.json", help="The report.")
@report_path_option(
    "--plot",
    "plot_path",
    default="compare.png",
    help="Attainment and interactive attainment vs load, per policy.",
)
def compare(
    policies,
    model,
    rates,
    flags,
    num_requests,
    request_timeout,
    serve_args,
    ready_timeout,
    log_dir,
    json_path,
    plot_path,
    **bounds,  # the flags that CompareSettings takes by their own names (--capacity, ...)
) -> None:
    """Start a fresh server per policy and load, send each the same requests at the same times
    (the policies' order rotating from load to load), and write one JSON and one PNG."""
    if flags.time_scale is not None:
        raise BenchInputError(
            "--time-scale does not apply to compare: --rates sets each point's rate"
        )
    if num_requests is None and not flags.name.startswith("trace:"):
        num_requests = DEFAULT_REQUESTS
    plan = flags.plan(num_requests)
    try:
        plan.items()  # the workload's errors now, not after a server start
        settings = CompareSettings(
            _policies(policies),
            model,
            tuple(parse_loads(rates)),
            plan,
            tuple(serve_args),
            request_timeout_s=request_timeout,
            ready_timeout_s=ready_timeout,
            log_dir=log_dir,
            **bounds,
        )
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    runner = Comparison(
        settings,
        progress=lambda label, total: Progress(total, label),
        log=lambda line: click.echo(line, err=True),
    )
    try:
        report = runner.run()
    except (RuntimeError, ConnectionError, ValueError) as exc:
        raise BenchInputError(f"compare stopped: {exc}") from None
    click.echo(format_compare(report))
    try:
        write_json(report, json_path)
        write_compare_plot(report, plot_path)
    except OSError as exc:
        raise BenchInputError(f"cannot write the report: {exc}") from None
    click.echo(f"wrote {json_path} and {plot_path}")
