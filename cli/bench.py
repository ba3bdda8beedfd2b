"""`sloserve bench`: load-test a running server and report TTFT / TPOT / ITL / E2E, SLO attainment, goodput."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import sys
from dataclasses import replace

import click
from sloserve.bench.client import LoadSpec, RunResult, connect, fetch_info, run_load, wait_ready
from sloserve.bench.goodput_search import (
    SearchResult,
    SearchSettings,
    format_search,
    search_goodput,
)
from sloserve.bench.plan import WorkloadPlan
from sloserve.bench.report import build_report, format_table, rate_label, write_json, write_plot
from sloserve.bench.stats import summarise
from sloserve.bench.workloads import load_workload
from sloserve.cli.bench_common import (
    BenchInputError,
    OneLineGroup,
    Progress,
    parse_rates,
    report_path_option,
    run_slo,
    workload_options,
)
from sloserve.cli.bench_compare import compare
from sloserve.cli.common import auth_token_option
from sloserve.structured import arc_grid_lark

DEFAULT_REQUESTS = 200  # when neither --num-requests nor --duration is given


def require_bench_extra(url: str | None, plot_path: str | None) -> None:
    """aiohttp (--url) and matplotlib (--plot) come with the `bench` extra: say so before any load is sent."""
    needs = [("aiohttp", "--url")] if url is not None else []
    if plot_path is not None:
        needs.append(("matplotlib", "--plot"))
    missing = [
        f"{module} (for {flag})"
        for module, flag in needs
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        raise BenchInputError(
            f"sloserve bench needs {' and '.join(missing)}, which is not installed: "
            "pip install 'sloserve[bench]'"
        )


@contextlib.asynccontextmanager
async def _session(
    server: str,
    url: str | None,
    auth_token: str | None,
    connect_timeout: float,
    ready_timeout: float,
):
    """(the server's info, `await send(items, spec, progress, id_prefix)` -> RunResult) over gRPC or HTTP."""
    if url is not None:
        from sloserve.bench import http_client

        async with http_client.open_client(url, auth_token, connect_timeout) as client:
            await http_client.wait_ready(client, ready_timeout)
            info = await http_client.fetch_info(client)

            async def send_http(items, spec, progress, id_prefix):
                return await http_client.run_load(
                    client, items, spec, progress, id_prefix=id_prefix, model=info.get("model")
                )

            yield info, send_http
        return
    channel = await connect(server, connect_timeout)
    try:
        await wait_ready(channel, ready_timeout, auth_token)
        info = await fetch_info(channel, auth_token)

        async def send_grpc(items, spec, progress, id_prefix):
            return await run_load(channel, items, spec, progress, id_prefix=id_prefix)

        yield info, send_grpc
    finally:
        await channel.close()


@click.group("bench", cls=OneLineGroup, invoke_without_command=True)
@click.option(
    "--server",
    default="127.0.0.1:50051",
    show_default=True,
    help="HOST:PORT of a running sloserve.",
)
@click.option(
    "--url",
    default=None,
    help="Drive the OpenAI-compatible HTTP API at this base URL (http://HOST:PORT) instead of gRPC.",
)
@workload_options
@click.option(
    "--num-requests",
    type=int,
    default=None,
    help=f"Requests per rate [default: {DEFAULT_REQUESTS}, a trace's length, or --duration].",
)
@click.option("--duration", type=float, default=None, help="Seconds to keep sending at each rate.")
@click.option(
    "--rate",
    default="inf",
    show_default=True,
    help="Poisson arrivals per second (a trace: its mean rate, shape kept); a list R1,R2,... sweeps; "
    "inf sends without pacing (a trace: as recorded).",
)
@click.option(
    "--concurrency",
    type=int,
    default=None,
    help="Most requests in flight (closed loop with rate inf).",
)
@click.option(
    "--streams",
    default=4,
    show_default=True,
    type=int,
    help="Bidirectional streams to spread requests over.",
)
@click.option("--slo-ttft", type=float, default=None, help="Time-to-first-token objective (s).")
@click.option("--slo-tpot", type=float, default=None, help="Time-per-output-token objective (s).")
@click.option("--slo-e2e", type=float, default=None, help="End-to-end objective (s).")
@click.option(
    "--goodput-search",
    is_flag=True,
    help="Search for the highest rate meeting --attainment (goodput as DistServe defines it), from --rate "
    "(one rate: the start; two: a known met,missed bracket).",
)
@click.option(
    "--attainment",
    default=0.9,
    show_default=True,
    type=float,
    help="Share of requests that must meet their objectives in --goodput-search.",
)
@click.option(
    "--search-repeats",
    default=2,
    show_default=True,
    type=int,
    help="Runs per rate in --goodput-search.",
)
@click.option(
    "--search-tolerance",
    default=0.05,
    show_default=True,
    type=float,
    help="--goodput-search stops when its bracket is this close (relative).",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=float,
    help="Sampling temperature (0 = greedy).",
)
@click.option("--ignore-eos", is_flag=True, help="Generate exactly max_tokens for every request.")
@click.option(
    "--arc-grid-grammar",
    is_flag=True,
    help="Constrain every answer to one ARC grid (digit rows of one width, then EOS) by the server's "
    "structured output.",
)
@click.option(
    "--request-timeout",
    default=600.0,
    show_default=True,
    type=float,
    help="Cancel and count as failed a request open this long (s).",
)
@click.option(
    "--connect-timeout",
    default=10.0,
    show_default=True,
    type=float,
    help="Seconds to reach the server.",
)
@click.option(
    "--ready-timeout",
    default=300.0,
    show_default=True,
    type=float,
    help="Seconds to wait for the server's model to be loaded.",
)
@auth_token_option
@report_path_option("--json", "json_path", default=None, help="Write the report as JSON here.")
@report_path_option(
    "--plot",
    "plot_path",
    default=None,
    help="Write latency CDFs (and, for a sweep, attainment and P99 vs rate) as a PNG.",
)
@click.pass_context
def bench(
    ctx,
    server,
    url,
    flags,
    num_requests,
    duration,
    rate,
    concurrency,
    streams,
    slo_ttft,
    slo_tpot,
    slo_e2e,
    goodput_search,
    attainment,
    search_repeats,
    search_tolerance,
    temperature,
    ignore_eos,
    arc_grid_grammar,
    request_timeout,
    connect_timeout,
    ready_timeout,
    auth_token,
    json_path,
    plot_path,
) -> None:
    """Send a workload to a running server and report latency, throughput, SLO attainment, goodput.

    Requests are also grouped by SLO class (a JSONL line's `class`, a rule's, else its objectives),
    with attainment and goodput per class. `sloserve bench compare` sets policies side by side.
    """
    if ctx.invoked_subcommand is not None:
        return
    rates = parse_rates(rate)
    if url is not None and not url.startswith(("http://", "https://")):
        raise BenchInputError(f"--url must start with http:// or https://, got {url!r}")
    if goodput_search and len(rates) > 2:
        raise BenchInputError(
            "--goodput-search takes --rate START or --rate MET,MISSED, not a longer list"
        )
    if flags.time_scale is not None and any(math.isfinite(r) for r in rates):
        raise BenchInputError("give --time-scale or --rate for a trace, not both")
    require_bench_extra(url, plot_path)
    slo = run_slo(slo_ttft, slo_tpot, slo_e2e)
    workload = flags.name
    trace = workload.startswith("trace:")
    defaulted = num_requests is None and duration is None and not trace
    if defaulted:
        num_requests = DEFAULT_REQUESTS
    plan = flags.plan(None if duration is not None else num_requests)
    try:
        # read from a file: repeated to fill
        if defaulted and workload.startswith(("jsonl:", "arc:")):
            held = len(load_workload(workload, seed=flags.seed, attempts=flags.attempts))
            if held < num_requests:
                click.echo(
                    f"note: {workload} holds {held} requests, so the default {num_requests} repeat them "
                    f"(a repeated prompt can hit the prefix cache); --num-requests {held} sends each once",
                    err=True,
                )
        specs = [
            LoadSpec(
                rate=r,
                concurrency=concurrency,
                num_requests=num_requests,
                duration_s=duration,
                streams=streams,
                seed=flags.seed + i,
                slo=slo,
                temperature=temperature,
                ignore_eos=ignore_eos,
                request_timeout_s=request_timeout,
                auth_token=auth_token,
                grammar=arc_grid_lark() if arc_grid_grammar else None,
            )
            for i, r in enumerate(rates)
        ]
        total = len(plan.items())  # reads the workload: its errors before connecting
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None
    search = None
    if goodput_search:
        try:
            search = SearchSettings(attainment, search_repeats, search_tolerance)
        except ValueError as exc:
            raise BenchInputError(str(exc)) from None
    progress = Progress(None if duration is not None or search else (total or 0) * len(rates))
    try:
        with progress:
            info, results, found = asyncio.run(
                _bench(
                    server,
                    url,
                    auth_token,
                    connect_timeout,
                    ready_timeout,
                    plan,
                    specs,
                    progress,
                    search,
                )
            )
    except ConnectionError as exc:
        raise BenchInputError(str(exc)) from None
    # the plan against this server (a trace too long for its context, ...)
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None
    runs = [summarise(r.records, r.duration_s, slo, r.rate) for r in results]
    for run, result in zip(runs, results, strict=True):
        run["rate_label"] = rate_label(result.rate)
    config = {
        "attempts": flags.attempts,
        "max_tokens": flags.max_tokens,
        "num_requests": num_requests,
        "duration_s": duration,
        "rates": [rate_label(r) for r in rates],
        "concurrency": concurrency,
        "streams": streams,
        "seed": flags.seed,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "length_scale": flags.length_scale,
        "time_scale": flags.time_scale,
        "slo_rules": [r.text for r in plan.rules],
        "arc_grid_grammar": arc_grid_grammar,
        "slo": None
        if slo is None
        else {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s},
    }
    target = url or server
    report = build_report(target, info, workload, config, runs)
    click.echo(
        f"server {target}  model {info.get('model', '?')}  device {info.get('device', '?')}  "
        f"workload {workload}"
    )
    click.echo(format_table(runs))
    if found is not None:
        report["goodput_search"] = found.as_dict()
        click.echo(format_search(found))
    try:
        if json_path:
            write_json(report, json_path)
        if plot_path:
            write_plot(results, runs, plot_path)
    except OSError as exc:
        raise BenchInputError(f"cannot write the report: {exc}") from None
    if not any(run["completed"] for run in runs):
        click.echo("error: no request completed; see the refusals above", err=True)
        sys.exit(1)


async def _bench(
    server,
    url,
    auth_token,
    connect_timeout,
    ready_timeout,
    plan: WorkloadPlan,
    specs: list[LoadSpec],
    progress: Progress,
    search: SearchSettings | None,
) -> tuple[dict, list[RunResult], SearchResult | None]:
    """Connect, build the requests for this server, then run each rate (or the goodput search)."""
    async with _session(server, url, auth_token, connect_timeout, ready_timeout) as (info, send):
        items = plan.items(info.get("max_model_len") or None)
        if search is None:
            results = [
                await send(plan.at_rate(items, spec.rate), spec, progress, f"bench{i}")
                for i, spec in enumerate(specs)
            ]
            return info, results, None
        results: list[RunResult] = []

        async def measure(rate: float, repeat: int) -> float:
            spec = replace(specs[0], rate=rate, seed=specs[0].seed + repeat)
            result = await send(plan.at_rate(items, rate), spec, None, f"search{len(results)}")
            results.append(result)
            figures = summarise(result.records, result.duration_s, spec.slo, rate)
            click.echo(
                f"goodput search: {rate:.3g} req/s run {repeat + 1}: attainment "
                f"{100 * (figures['slo_attainment'] or 0):.1f}%",
                err=True,
            )
            return figures["slo_attainment"] or 0.0

        rates = [spec.rate for spec in specs]
        found = await search_goodput(
            measure,
            rates[0],
            search,
            low=rates[0] if len(rates) == 2 else None,
            high=rates[1] if len(rates) == 2 else None,
        )
        return info, results, found


bench.add_command(compare)

if __name__ == "__main__":
    bench()
