"""Trace replay: requests with the arrival times and lengths of a production trace, rescaled keeping its shape.

``trace:FILE`` reads
  * a CSV with a header: the Azure LLM inference traces (``TIMESTAMP,ContextTokens,GeneratedTokens``,
    2023 and 2024) or BurstGPT (``Timestamp`` in seconds, ``Request tokens``, ``Response tokens``);
  * JSONL: a bench JSONL line (prompt, max_tokens, objectives, class, priority) plus ``arrival_s``
    (seconds), or lengths in place of the prompt: ``input_length`` / ``output_length`` with
    ``arrival_s`` or ``timestamp`` in milliseconds (Mooncake's traces).
``trace:azure-conv`` names the committed sample (sloserve/bench/traces/README.md).

A length given in tokens becomes a prompt of that many random digits (one token per digit with the
built-in byte-level model and with tokenizers that split digits) and exactly that many output
tokens (end-of-sequence ignored), as Splitwise replays the Azure trace. ``length_scale``
multiplies both; a request longer than the model's context is cut, prompt and output in
proportion. Arrivals start at 0; ``time_scale`` multiplies the gaps, or ``rate`` sets the mean
rate, either way keeping the trace's shape (its inter-arrival coefficient of variation).
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np
from sloserve.bench.slo_rules import SloRule, apply_rules
from sloserve.bench.workloads import WorkloadItem, json_lines, jsonl_item

TRACES = Path(__file__).resolve().parent / "traces"
NAMED = {"azure-conv": TRACES / "azure_conv_2023.csv"}
CONTEXT_MARGIN = 8  # tokens left free of the context: a BOS and a chat template's few
_CSV_COLUMNS = (
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),  # Azure 2023 / 2024
    ("Timestamp", "Request tokens", "Response tokens"),
)  # BurstGPT


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One line of a trace: when it arrived (s), its lengths in tokens, or a ready request."""

    arrival_s: float
    prompt_tokens: int = 0
    gen_tokens: int = 0
    item: WorkloadItem | None = None  # a JSONL line with its own prompt


def trace_path(arg: str) -> Path:
    """The file a trace: spec names (a committed sample's name or a path)."""
    path = NAMED.get(arg, Path(arg))
    if not path.is_file():
        raise ValueError(
            f"trace {arg!r} is not a file nor one of the named samples ({', '.join(NAMED)})"
        )
    return path


def read_trace(arg: str) -> list[TraceRequest]:
    """Every request of a trace file, in arrival order, arrivals shifted to start at 0."""
    path = trace_path(arg)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace {str(path)!r}: {exc}") from None
    rows = _jsonl(text, path) if path.suffix in (".jsonl", ".json") else _csv(text, path)
    if not rows:
        raise ValueError(f"trace {str(path)!r} holds no requests")
    rows.sort(key=lambda r: r.arrival_s)
    first = rows[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - first) for r in rows]


def _timestamp(text: str) -> float:
    """Seconds: a number, or an ISO date-time with any number of fraction digits (Azure writes 7)."""
    try:
        return float(text)
    except ValueError:
        pass
    base, _, fraction = text.strip().partition(".")
    seconds = datetime.fromisoformat(base).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def _count(value: object, name: str, where: str) -> int:
    try:
        count = int(str(value).strip())
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{where}: {name} must be a whole number of tokens >= 0, got {value!r}")
    return count


def _csv(text: str, path: Path) -> list[TraceRequest]:
    reader = csv.reader(text.splitlines())
    header = [h.strip() for h in next(reader, [])]
    columns = next((c for c in _CSV_COLUMNS if set(c) <= set(header)), None)
    if columns is None:
        raise ValueError(
            f"{path}:1: the header must name {', '.join(_CSV_COLUMNS[0])} (Azure) or "
            f"{', '.join(_CSV_COLUMNS[1])} (BurstGPT), got {','.join(header)!r}"
        )
    index = [header.index(c) for c in columns]
    rows = []
    for number, row in enumerate(reader, 2):
        if not row or not any(cell.strip() for cell in row):
            continue
        where = f"{path}:{number}"
        if len(row) != len(header):
            raise ValueError(
                f"{where}: expected {len(header)} columns ({','.join(header)}), got {len(row)}"
            )
        stamp, prompt, gen = (row[i] for i in index)
        try:
            arrival = _timestamp(stamp)
        except ValueError:
            raise ValueError(
                f"{where}: cannot read the time {stamp!r} (a date-time or seconds)"
            ) from None
        rows.append(
            TraceRequest(arrival, _count(prompt, columns[1], where), _count(gen, columns[2], where))
        )
    return rows


def _arrival(line: dict, where: str) -> float:
    if "arrival_s" in line:
        value, scale = line["arrival_s"], 1.0
    elif "timestamp" in line:
        value, scale = line["timestamp"], 1e-3
    else:
        raise ValueError(
            f"{where}: a trace line needs 'arrival_s' (seconds) or 'timestamp' (milliseconds)"
        )
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{where}: the arrival time must be a number >= 0, got {value!r}")
    return float(value) * scale


def _jsonl(text: str, path: Path) -> list[TraceRequest]:
    rows = []
    for where, line in json_lines(text, path):
        if not isinstance(line, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        arrival = _arrival(line, where)
        if "prompt" in line:
            rows.append(TraceRequest(arrival, item=jsonl_item(line, where)))
        elif "input_length" in line and "output_length" in line:
            rows.append(
                TraceRequest(
                    arrival,
                    _count(line["input_length"], "input_length", where),
                    _count(line["output_length"], "output_length", where),
                )
            )
        else:
            raise ValueError(
                f"{where}: a trace line needs a 'prompt' or 'input_length' and 'output_length'"
            )
    return rows


def fit_lengths(
    prompt: int, gen: int, length_scale: float, max_model_len: int | None
) -> tuple[int, int]:
    """(prompt, output) tokens: scaled, at least 1 each, cut in proportion to fit the context."""
    prompt, gen = max(1, round(prompt * length_scale)), max(1, round(gen * length_scale))
    room = None if max_model_len is None else max_model_len - CONTEXT_MARGIN
    if room is not None and prompt + gen > room:
        if room < 2:
            raise ValueError(
                f"the model's context ({max_model_len} tokens) is too short to replay a trace"
            )
        factor = room / (prompt + gen)
        prompt, gen = max(1, math.floor(prompt * factor)), max(1, math.floor(gen * factor))
    return prompt, gen


def trace_items(
    rows: list[TraceRequest],
    *,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    rules: list[SloRule] | tuple = (),
    seed: int = 0,
) -> list[WorkloadItem]:
    """The requests to send, with their arrival times; rules see the trace's own lengths."""
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"--length-scale must be a number > 0, got {length_scale:g}")
    rng = random.Random(seed)
    items, lengths = [], []
    for row in rows:
        if row.item is not None:
            items.append(replace(row.item, arrival_s=row.arrival_s))
            lengths.append((len(row.item.prompt), row.item.max_tokens))
            continue
        prompt, gen = fit_lengths(row.prompt_tokens, row.gen_tokens, length_scale, max_model_len)
        items.append(
            WorkloadItem(
                "".join(rng.choices("0123456789", k=prompt)),
                gen,
                ignore_eos=True,
                arrival_s=row.arrival_s,
            )
        )
        lengths.append((row.prompt_tokens, row.gen_tokens))
    return apply_rules(list(rules), items, lengths)


def mean_rate(items: list[WorkloadItem]) -> float:
    """Requests per second between the first and the last arrival (inf for a single instant)."""
    span = items[-1].arrival_s - items[0].arrival_s
    return (len(items) - 1) / span if span > 0 else math.inf


def rescale(
    items: list[WorkloadItem], *, time_scale: float | None = None, rate: float | None = None
) -> list[WorkloadItem]:
    """The items with every arrival multiplied by time_scale, or scaled to a mean rate (req/s)."""
    if time_scale is not None and rate is not None:
        raise ValueError("give --time-scale or --rate for a trace, not both")
    if rate is not None and math.isfinite(rate):
        current = mean_rate(items)
        time_scale = current / rate if math.isfinite(current) else 1.0
    if time_scale is None or time_scale == 1.0:
        return items
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"--time-scale must be a number > 0, got {time_scale:g}")
    return [replace(i, arrival_s=i.arrival_s * time_scale) for i in items]


def tile(items: list[WorkloadItem], n: int) -> list[WorkloadItem]:
    """n requests: the trace repeated back to back (one mean gap between passes) as needed."""
    span = items[-1].arrival_s - items[0].arrival_s
    period = span + (span / (len(items) - 1) if len(items) > 1 and span > 0 else 1.0)
    return [
        replace(
            items[k % len(items)],
            arrival_s=items[k % len(items)].arrival_s + (k // len(items)) * period,
        )
        for k in range(n)
    ]


def interarrival_cv(arrivals: list[float]) -> float:
    """Coefficient of variation (std / mean) of the gaps between sorted arrival times."""
    gaps = np.diff(np.sort(np.asarray(arrivals, dtype=np.float64)))
    if gaps.size == 0 or gaps.mean() <= 0:
        raise ValueError("the coefficient of variation needs at least two distinct arrival times")
    return float(gaps.std() / gaps.mean())


def load_trace(
    arg: str,
    *,
    seed: int = 0,
    num_requests: int | None = None,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    rules: list[SloRule] | tuple = (),
) -> list[WorkloadItem]:
    """A trace: spec's requests (all of them, or num_requests, repeating the trace as needed)."""
    items = trace_items(
        read_trace(arg),
        length_scale=length_scale,
        max_model_len=max_model_len,
        rules=rules,
        seed=seed,
    )
    return items if num_requests is None else tile(items, num_requests)
