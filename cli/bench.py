"""`sloserve bench`: load-test a running server and report TTFT / TPOT / ITL / E2E, SLO attainment, goodput."""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import replace

import click
from sloserve.bench.client import LoadSpec, RunResult, connect, fetch_info, run_load, wait_ready
from sloserve.bench.report import build_report, format_table, rate_label, write_json, write_plot
from sloserve.bench.stats import RequestRecord, summarise
from sloserve.bench.workloads import default_workload, load_workload
from sloserve.sampling_params import SLO
from sloserve.structured import arc_grid_lark

DEFAULT_REQUESTS = 200  # when neither --num-requests nor --duration is given


class BenchInputError(click.ClickException):
    """Bad input: one line on stderr, exit status 2."""

    exit_code = 2


class _OneLineCommand(click.Command):
    """A click command whose usage errors print as one line (exit 2) instead of a usage block."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise BenchInputError(exc.format_message()) from None


def parse_rates(text: str) -> list[float]:
    """'inf' or 'R' or 'R1,R2,...' (requests/s, each > 0) -> list of rates."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise BenchInputError(f"--rate: cannot read {part!r}; use a number, a list like 1,2,4, or inf") from None
        if not rate > 0:
            raise BenchInputError(f"--rate must be > 0 requests/s, got {part!r}")
        rates.append(rate)
    return rates


def _slo(ttft: float | None, tpot: float | None, e2e: float | None) -> SLO | None:
    for flag, value in (("--slo-ttft", ttft), ("--slo-tpot", tpot), ("--slo-e2e", e2e)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BenchInputError(f"{flag} must be a number of seconds > 0, got {value:g}")
    return None if ttft is None and tpot is None and e2e is None else SLO(ttft, tpot, e2e)


async def _run_http(url: str, items: list, specs: list[LoadSpec], connect_timeout: float,
                    ready_timeout: float, progress) -> tuple[dict, list[RunResult]]:
    from sloserve.bench import http_client

    async with http_client.open_client(url, specs[0].auth_token, connect_timeout) as client:
        await http_client.wait_ready(client, ready_timeout)
        info = await http_client.fetch_info(client)
        results = []
        for i, spec in enumerate(specs):
            results.append(await http_client.run_load(client, items, spec, progress, id_prefix=f"bench{i}",
                                                      model=info.get("model")))
        return info, results


async def _run(server: str, items: list, specs: list[LoadSpec], connect_timeout: float,
               ready_timeout: float, progress) -> tuple[dict, list[RunResult]]:
    channel = await connect(server, connect_timeout)
    try:
        await wait_ready(channel, ready_timeout, specs[0].auth_token)
        info = await fetch_info(channel, specs[0].auth_token)
        results = []
        for i, spec in enumerate(specs):
            results.append(await run_load(channel, items, spec, progress, id_prefix=f"bench{i}"))
        return info, results
    finally:
        await channel.close()


@click.command("bench", cls=_OneLineCommand)
@click.option("--server", default="127.0.0.1:50051", show_default=True, help="HOST:PORT of a running sloserve.")
@click.option("--url", default=None,
              help="Drive the OpenAI-compatible HTTP API at this base URL (http://HOST:PORT) instead of gRPC.")
@click.option("--workload", default=None,
              help="arc:DIR, jsonl:FILE, synthetic-arc or fixed:PROMPT_TOKENS,OUTPUT_TOKENS "
                   "[default: the ARC-AGI-2 trace if present, else synthetic-arc]")
@click.option("--attempts", default=2, show_default=True, type=int, help="Copies of each ARC test input.")
@click.option("--max-tokens", type=int, default=None,
              help="Cap on each request's output tokens [default: the workload's].")
@click.option("--num-requests", type=int, default=None,
              help=f"Requests per rate [default: {DEFAULT_REQUESTS}, unless --duration].")
@click.option("--duration", type=float, default=None, help="Seconds to keep sending at each rate.")
@click.option("--rate", default="inf", show_default=True,
              help="Poisson arrivals per second; a list R1,R2,... sweeps; inf sends without pacing.")
@click.option("--concurrency", type=int, default=None, help="Most requests in flight (closed loop with rate inf).")
@click.option("--streams", default=4, show_default=True, type=int, help="Bidirectional streams to spread requests over.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the workload order and arrivals.")
@click.option("--slo-ttft", type=float, default=None, help="Time-to-first-token objective (s).")
@click.option("--slo-tpot", type=float, default=None, help="Time-per-output-token objective (s).")
@click.option("--slo-e2e", type=float, default=None, help="End-to-end objective (s).")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="Sampling temperature (0 = greedy).")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly max_tokens for every request.")
@click.option("--arc-grid-grammar", is_flag=True,
              help="Constrain every answer to one ARC grid (digit rows of one width, then EOS) by the server's "
                   "structured output.")
@click.option("--request-timeout", default=600.0, show_default=True, type=float,
              help="Cancel and count as failed a request open this long (s).")
@click.option("--connect-timeout", default=10.0, show_default=True, type=float, help="Seconds to reach the server.")
@click.option("--ready-timeout", default=300.0, show_default=True, type=float,
              help="Seconds to wait for the server's model to be loaded.")
@click.option("--auth-token", envvar="SLOSERVE_AUTH_TOKEN", default=None, help="Bearer token of the server.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the report as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write latency CDFs (and, for a sweep, attainment and P99 vs rate) as a PNG.")
def bench(server, url, workload, attempts, max_tokens, num_requests, duration, rate, concurrency, streams, seed,
          slo_ttft, slo_tpot, slo_e2e, temperature, ignore_eos, arc_grid_grammar, request_timeout, connect_timeout,
          ready_timeout, auth_token, json_path, plot_path) -> None:
    """Send a workload to a running server and report latency, throughput, SLO attainment, goodput.

    Requests are also grouped by SLO class (a JSONL line's `class`, else its objectives), with
    attainment and goodput per class.
    """
    rates = parse_rates(rate)
    if url is not None and not url.startswith(("http://", "https://")):
        raise BenchInputError(f"--url must start with http:// or https://, got {url!r}")
    slo = _slo(slo_ttft, slo_tpot, slo_e2e)
    workload = workload or default_workload()
    defaulted = num_requests is None and duration is None
    if defaulted:
        num_requests = DEFAULT_REQUESTS
    try:
        items = load_workload(workload, seed=seed, attempts=attempts,
                              num_requests=None if duration is not None else num_requests)
        if defaulted and workload.startswith(("jsonl:", "arc:")):  # read from a file: repeated to fill
            held = len(load_workload(workload, seed=seed, attempts=attempts))
            if held < num_requests:
                click.echo(f"note: {workload} holds {held} requests, so the default {num_requests} repeat them "
                           f"(a repeated prompt can hit the prefix cache); --num-requests {held} sends each once",
                           err=True)
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
            items = [replace(i, max_tokens=min(i.max_tokens, max_tokens)) for i in items]
        specs = [LoadSpec(rate=r, concurrency=concurrency, num_requests=num_requests,
                          duration_s=duration, streams=streams, seed=seed + i, slo=slo,
                          temperature=temperature, ignore_eos=ignore_eos,
                          request_timeout_s=request_timeout, auth_token=auth_token,
                          grammar=arc_grid_lark() if arc_grid_grammar else None)
                 for i, r in enumerate(rates)]
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None
    bar = None
    if sys.stdout.isatty() and duration is None:
        bar = click.progressbar(length=num_requests * len(rates), label="bench", file=sys.stdout)

    def progress(_: RequestRecord) -> None:
        if bar is not None:
            bar.update(1)

    try:
        if bar is not None:
            bar.__enter__()
        if url is not None:
            info, results = asyncio.run(_run_http(url, items, specs, connect_timeout, ready_timeout, progress))
        else:
            info, results = asyncio.run(_run(server, items, specs, connect_timeout, ready_timeout, progress))
    except ConnectionError as exc:
        raise BenchInputError(str(exc)) from None
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    runs = [summarise(r.records, r.duration_s, slo, r.rate) for r in results]
    for run, result in zip(runs, results, strict=True):
        run["rate_label"] = rate_label(result.rate)
    config = {"attempts": attempts, "max_tokens": max_tokens, "num_requests": num_requests, "duration_s": duration,
              "rates": [rate_label(r) for r in rates], "concurrency": concurrency, "streams": streams,
              "seed": seed, "temperature": temperature, "ignore_eos": ignore_eos,
              "arc_grid_grammar": arc_grid_grammar,
              "slo": None if slo is None else {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s}}
    target = url or server
    report = build_report(target, info, workload, config, runs)
    click.echo(f"server {target}  model {info.get('model', '?')}  device {info.get('device', '?')}  "
               f"workload {workload}")
    click.echo(format_table(runs))
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


if __name__ == "__main__":
    bench()
