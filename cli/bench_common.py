"""What `sloserve bench` and `sloserve bench compare` share: errors, the workload flags, the progress bar."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import click
from sloserve.bench.plan import WorkloadPlan
from sloserve.bench.slo_rules import load_rules_file, parse_rule
from sloserve.bench.workloads import default_workload
from sloserve.sampling_params import SLO


class BenchInputError(click.ClickException):
    """Bad input: one line on stderr, exit status 2."""

    exit_code = 2


class _OneLine:
    """Usage errors print as one line (exit 2) instead of a usage block."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise BenchInputError(exc.format_message()) from None


class OneLineCommand(_OneLine, click.Command):
    """A click command with one-line usage errors."""


class OneLineGroup(_OneLine, click.Group):
    """`sloserve bench`: runs itself without a subcommand; `compare` is its subcommand."""


def parse_rates(text: str) -> list[float]:
    """'inf' or 'R' or 'R1,R2,...' (requests/s, each > 0) -> list of rates."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise BenchInputError(
                f"--rate: cannot read {part!r}; use a number, a list like 1,2,4, or inf"
            ) from None
        if not rate > 0:
            raise BenchInputError(f"--rate must be > 0 requests/s, got {part!r}")
        rates.append(rate)
    return rates


def run_slo(ttft: float | None, tpot: float | None, e2e: float | None) -> SLO | None:
    for flag, value in (("--slo-ttft", ttft), ("--slo-tpot", tpot), ("--slo-e2e", e2e)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BenchInputError(f"{flag} must be a number of seconds > 0, got {value:g}")
    return None if ttft is None and tpot is None and e2e is None else SLO(ttft, tpot, e2e)


def workload_options(fn):
    """The flags that say what to send, passed to `fn` as one WorkloadFlags, `flags`."""
    decorators = [
        click.option(
            "--workload",
            default=None,
            help="arc:DIR, jsonl:FILE, synthetic-arc, fixed:PROMPT_TOKENS,OUTPUT_TOKENS, or trace:FILE / "
            "trace:azure-conv (arrival times and lengths: Azure CSV, BurstGPT CSV, JSONL with arrival_s) "
            "[default: the ARC-AGI-2 trace if present, else synthetic-arc]",
        ),
        click.option(
            "--attempts",
            default=2,
            show_default=True,
            type=int,
            help="Copies of each ARC test input.",
        ),
        click.option(
            "--max-tokens",
            type=int,
            default=None,
            help="Cap on each request's output tokens [default: the workload's].",
        ),
        click.option(
            "--length-scale",
            default=1.0,
            show_default=True,
            type=float,
            help="Trace: multiply prompt and output lengths (then cut to fit the server's context).",
        ),
        click.option(
            "--time-scale",
            default=None,
            type=float,
            help="Trace: multiply the gaps between arrivals (0.5 = twice as fast) [default: 1, or --rate].",
        ),
        click.option(
            "--slo-rule",
            "slo_rules",
            multiple=True,
            help="Objectives by request length, first match wins, e.g. 'gen>250:e2e=20,class=batch' "
            "'default:ttft=0.5,tpot=0.06,class=interactive,priority=0' (repeatable).",
        ),
        click.option(
            "--slo-rules",
            "slo_rules_file",
            type=click.Path(dir_okay=False),
            default=None,
            help="A YAML list of rules ({when: 'gen>250', e2e: 20, class: batch}), after any --slo-rule.",
        ),
        click.option(
            "--seed",
            default=0,
            show_default=True,
            type=int,
            help="Seed of the workload order and arrivals.",
        ),
    ]

    @functools.wraps(fn)
    def packed(*args, **kwargs):
        fields = {name: kwargs.pop(name) for name in WorkloadFlags.__slots__}
        return fn(*args, flags=WorkloadFlags(**fields), **kwargs)

    return functools.reduce(lambda f, d: d(f), reversed(decorators), packed)


@dataclass(frozen=True, slots=True)
class WorkloadFlags:
    """The flags that say what to send, as given (one value for `bench` and `bench compare`)."""

    workload: str | None
    attempts: int
    max_tokens: int | None
    length_scale: float
    time_scale: float | None
    slo_rules: tuple[str, ...]
    slo_rules_file: str | None
    seed: int

    @property
    def name(self) -> str:
        """The workload spec, or the default one."""
        return self.workload or default_workload()

    def plan(self, num_requests: int | None) -> WorkloadPlan:
        """The WorkloadPlan of these flags; bad input becomes a BenchInputError."""
        try:
            rules = [parse_rule(text) for text in self.slo_rules]
            if self.slo_rules_file:
                rules += load_rules_file(self.slo_rules_file)
            if self.attempts < 1:
                raise ValueError(f"--attempts must be >= 1, got {self.attempts}")
            return WorkloadPlan(
                self.name,
                seed=self.seed,
                attempts=self.attempts,
                num_requests=num_requests,
                max_tokens=self.max_tokens,
                length_scale=self.length_scale,
                time_scale=self.time_scale,
                rules=tuple(rules),
            )
        except ValueError as exc:
            raise BenchInputError(str(exc)) from None


def report_path_option(flag: str, name: str, *, default: str | None, help: str):
    """A click option naming a file the report is written to (--json, --plot)."""
    return click.option(
        flag,
        name,
        type=click.Path(dir_okay=False, writable=True),
        default=default,
        show_default=default is not None,
        help=help,
    )


class Progress:
    """A progress bar over `total` requests on stderr, only on a terminal (a no-op otherwise)."""

    def __init__(self, total: int | None, label: str = "bench") -> None:
        self._bar = None
        if total and sys.stderr.isatty():
            self._bar = click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True)

    def __call__(self, _record: object = None) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
