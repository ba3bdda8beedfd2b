"""Workloads for the load generator: ARC-AGI-2 folders, JSONL traces, synthetic ARC, fixed sizes.

Specs: ``arc:DIR``, ``jsonl:FILE``, ``synthetic-arc``, ``fixed:PROMPT_TOKENS,OUTPUT_TOKENS`` (and
``trace:FILE``, sloserve.bench.trace: requests with arrival times).
A JSONL line holds ``prompt`` and optionally ``expected_output``, ``max_tokens``, ``task_id`` (or
``group``), objectives (``slo: {ttft_s, tpot_s, e2e_s}`` or flat ``slo_ttft_s`` ...), ``class``
(the SLO class the report groups it under; by default a name derived from its objectives) and
``priority`` (an integer sent with the request; lower runs first under the priority policy).
A request with an expected output may generate that many tokens plus one, room for the
end-of-sequence after a complete answer (as vLLM's ``bench serve`` caps at the reference length);
a model stops earlier or later than the reference, so lengths are not known in advance.
Items that share a prefix (the test inputs and attempts of one ARC task) carry the same
``group`` and stay adjacent; groups are shuffled with ``seed``. When more requests are asked
for than the workload holds, it repeats from the start.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sloserve.bench.arc import synthetic_task, task_prompts
from sloserve.sampling_params import SLO

ARC_TRACE = (
    Path(__file__).resolve().parents[3]  # the checkout's ../shared
    / "shared/data/arc-agi-2/train_trace.jsonl"
)
DEFAULT_MAX_TOKENS = 128  # for JSONL lines with neither max_tokens nor expected_output
SYNTHETIC_TASKS = 1000  # synthetic-arc size when num_requests is not given (ARC-AGI-2 training)
FIXED_REQUESTS = 256  # fixed:P,O size when num_requests is not given
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # the wire's int32


def answer_budget(expected: str) -> int:
    """max_tokens for a request whose reference answer is `expected`: its tokens and an EOS."""
    return len(expected) + 1


@dataclass(slots=True, frozen=True)
class WorkloadItem:
    """One request to send: the prompt, how many tokens to ask for, and what to compare against."""

    prompt: str
    max_tokens: int
    expected_output: str | None = None
    group: str | None = None  # items of one group share a prompt prefix
    slo: SLO | None = None  # per-request objectives (JSONL); None: the run's SLO
    ignore_eos: bool = False  # generate exactly max_tokens (fixed workloads)
    # the report's class (JSONL 'class'); None: named after its objectives
    slo_class: str | None = None
    priority: int | None = None  # sent with the request when set (JSONL 'priority')
    # a trace's send time, from the run's start; None: the run's arrival process
    arrival_s: float | None = None


def default_workload() -> str:
    """The ARC trace when it is present on this machine, else the synthetic ARC workload."""
    return f"jsonl:{ARC_TRACE}" if ARC_TRACE.is_file() else "synthetic-arc"


def load_workload(
    spec: str, *, seed: int = 0, attempts: int = 2, num_requests: int | None = None
) -> list[WorkloadItem]:
    """Build the request list a spec names; ValueError says what is wrong with the spec or data.

    attempts applies to arc: and synthetic-arc (a JSONL trace already lists its attempts).
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"number of requests must be >= 1, got {num_requests}")
    kind, _, arg = spec.partition(":")
    rng = random.Random(seed)
    if kind == "arc" and arg:
        items = _arc_folder(Path(arg), attempts)
    elif kind == "jsonl" and arg:
        items = _jsonl(Path(arg))
    elif spec == "synthetic-arc":
        items = _synthetic(rng, attempts, num_requests)
    elif kind == "fixed" and arg:
        return _fixed(arg, rng, num_requests or FIXED_REQUESTS)
    else:
        raise ValueError(
            f"unknown workload {spec!r}: use arc:DIR, jsonl:FILE, synthetic-arc "
            "or fixed:PROMPT_TOKENS,OUTPUT_TOKENS"
        )
    if not items:
        raise ValueError(f"workload {spec!r} holds no requests")
    items = _shuffle_groups(items, rng)
    if num_requests is None:
        return items
    return [items[i % len(items)] for i in range(num_requests)]


def _shuffle_groups(items: list[WorkloadItem], rng: random.Random) -> list[WorkloadItem]:
    """Shuffle whole groups (first-appearance order), keeping each group's items together."""
    groups: dict[object, list[WorkloadItem]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item.group if item.group is not None else ("#", i), []).append(item)
    order = list(groups.values())
    rng.shuffle(order)
    return [item for group in order for item in group]


def _arc_items(task_id: str, task: object, attempts: int, where: str) -> list[WorkloadItem]:
    return [
        WorkloadItem(
            prompt, answer_budget(expected) if expected else DEFAULT_MAX_TOKENS, expected, task_id
        )
        for prompt, expected in task_prompts(task, where)
        for _ in range(attempts)
    ]


def _arc_folder(folder: Path, attempts: int) -> list[WorkloadItem]:
    if not folder.is_dir():
        raise ValueError(f"ARC workload folder {str(folder)!r} does not exist or is not a folder")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ValueError(f"ARC workload folder {str(folder)!r} has no *.json task files")
    items = []
    for path in files:
        try:
            task = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read ARC task {path}: {exc}") from exc
        items += _arc_items(path.stem, task, attempts, str(path))
    return items


def _slo_from(line: dict, where: str) -> SLO | None:
    """SLO fields of a JSONL line: an 'slo' object or flat slo_ttft_s / slo_tpot_s / slo_e2e_s."""
    nested = line.get("slo")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"{where}: 'slo' must be an object with ttft_s, tpot_s, e2e_s")
    values = {}
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        value = (nested or {}).get(name, line.get(f"slo_{name}"))
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}: SLO {name} must be a number of seconds, got {value!r}")
            values[name] = float(value)
    if not values:
        return None
    try:
        return SLO(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def jsonl_item(line: object, where: str) -> WorkloadItem:
    if not isinstance(line, dict) or not isinstance(line.get("prompt"), str) or not line["prompt"]:
        raise ValueError(
            f"{where}: each line must be a JSON object with a non-empty 'prompt' string"
        )
    expected = line.get("expected_output")
    if expected is not None and not isinstance(expected, str):
        raise ValueError(f"{where}: 'expected_output' must be a string")
    max_tokens = line.get("max_tokens")
    if max_tokens is None:
        max_tokens = answer_budget(expected) if expected else DEFAULT_MAX_TOKENS
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    group = line.get("task_id", line.get("group"))
    slo_class = line.get("class")
    if slo_class is not None and (not isinstance(slo_class, str) or not slo_class.strip()):
        raise ValueError(
            f"{where}: 'class' must be a non-empty string naming the SLO class, got {slo_class!r}"
        )
    priority = line.get("priority")
    low, high = PRIORITY_RANGE
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high
    ):
        raise ValueError(
            f"{where}: 'priority' must be an integer in [{low}, {high}] (lower runs first), "
            f"got {priority!r}"
        )
    return WorkloadItem(
        line["prompt"],
        max_tokens,
        expected,
        None if group is None else str(group),
        _slo_from(line, where),
        slo_class=slo_class,
        priority=priority,
    )


def _jsonl(path: Path) -> list[WorkloadItem]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read JSONL workload {str(path)!r}: {exc}") from exc
    return [jsonl_item(line, where) for where, line in json_lines(text, path)]


def json_lines(text: str, path: Path) -> Iterator[tuple[str, object]]:
    """('FILE:LINE', the parsed line) for each non-blank line; ValueError names a line that is not JSON."""
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield where, json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None


def _synthetic(rng: random.Random, attempts: int, num_requests: int | None) -> list[WorkloadItem]:
    """Synthetic ARC tasks, enough for num_requests (or SYNTHETIC_TASKS tasks)."""
    items: list[WorkloadItem] = []
    task = 0
    while (num_requests is None and task < SYNTHETIC_TASKS) or (
        num_requests is not None and len(items) < num_requests
    ):
        items += _arc_items(f"synthetic-{task:04d}", synthetic_task(rng), attempts, "synthetic")
        task += 1
    return items


def _fixed(arg: str, rng: random.Random, count: int) -> list[WorkloadItem]:
    """Prompts of random digits (one token per digit in tokenizers that split digits)."""
    try:
        prompt_tokens, output_tokens = (int(x) for x in arg.split(","))
    except ValueError:
        raise ValueError(
            f"fixed workload needs two integers: fixed:PROMPT_TOKENS,OUTPUT_TOKENS, got fixed:{arg}"
        ) from None
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"fixed workload sizes must be >= 1, got fixed:{arg}")
    return [
        WorkloadItem(
            "".join(rng.choices("0123456789", k=prompt_tokens)), output_tokens, ignore_eos=True
        )
        for _ in range(count)
    ]
