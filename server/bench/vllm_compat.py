"""The figures `vllm bench serve` writes for a run, under its own names and units (ms), so a
sloserve run can be set beside a vLLM one without conversion.

Same definitions as vLLM's: TTFT, TPOT (requests with more than one output token), ITL (every
gap between chunks), E2EL (end-to-end latency) over completed requests; ``median`` and ``p99``
by numpy's linear interpolation, ``std`` the population standard deviation; throughputs per
second of the run; ``request_goodput`` the requests that met their objectives per second.
"""

from __future__ import annotations

import numpy as np
from sloserve.bench.record import RequestRecord

PERCENTILES = (99,)  # vLLM's default --metric-percentiles
METRICS = ("ttft", "tpot", "itl", "e2el")


def _latency_fields(name: str, values: list[float]) -> dict[str, float | None]:
    ms = np.asarray(values, dtype=np.float64) * 1e3
    if not ms.size:
        return {
            f"{k}_{name}_ms": None
            for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))
        }
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        **{f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES},
    }


def vllm_fields(records: list[RequestRecord], duration_s: float, met: int) -> dict:
    """`vllm bench serve`'s result fields for these records (met: requests that met their objectives)."""
    done = [r for r in records if r.status == "ok"]
    seconds = duration_s if duration_s > 0 else float("nan")
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    per_metric = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2e for r in done if r.e2e is not None],
    }
    fields = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": _finite(len(done) / seconds),
        "request_goodput": _finite(met / seconds),
        "output_throughput": _finite(output / seconds),
        "total_token_throughput": _finite((prompt + output) / seconds),
    }
    for name in METRICS:
        fields.update(_latency_fields(name, per_metric[name]))
    return fields


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None
