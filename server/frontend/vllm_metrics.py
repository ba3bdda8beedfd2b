"""`--metrics-compat vllm`: the few vllm:-named series gateways and dashboards scrape, from sloserve's own.

The Gateway API Inference Extension's endpoint picker reads vllm:num_requests_waiting,
vllm:num_requests_running and vllm:kv_cache_usage_perc (a 0-1 ratio despite its name; older
releases called it vllm:gpu_cache_usage_perc); common dashboards add the latency histograms and
token counters. Each is sloserve's own series under vLLM's name (same buckets, same values), so
nothing is measured twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sloserve.frontend.engine_metrics import Families, kv_cache_usage

# vLLM's finished_reason label of vllm:request_success_total, by sloserve's outcome
_FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class VllmCollector(Collector):
    """vLLM-named copies: gauges and token counters from engine stats, histograms and successes renamed."""

    def __init__(
        self,
        engine_stats: Callable[[], Any],
        model_name: str,
        *,
        histograms: dict[str, Any],
        requests: Any,
    ) -> None:
        self._stats = engine_stats
        self._f = Families(model_name)
        self._histograms = histograms  # vllm name -> sloserve Histogram
        self._requests = requests  # sloserve_requests{model_name, outcome}

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        for name, histogram in self._histograms.items():
            yield from _renamed(histogram, name)
        yield self._successes()
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - an engine not yet started has no stats to report
            return
        f = self._f
        yield f.gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield f.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        usage = kv_cache_usage(s)
        yield f.gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield f.gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage (the older name). 1 means 100 percent usage.",
            usage,
        )
        yield f.counter("vllm:prompt_tokens", "Prompt tokens received.", s.prompt_tokens_total)
        yield f.counter("vllm:generation_tokens", "Tokens generated.", s.generated_tokens_total)
        yield f.counter(
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.",
            getattr(s, "spec_drafts_total", 0),
        )
        yield f.counter(
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            getattr(s, "spec_drafted_tokens_total", 0),
        )
        yield f.counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            getattr(s, "spec_accepted_tokens_total", 0),
        )

    def _successes(self) -> CounterMetricFamily:
        counts = dict.fromkeys(_FINISHED_REASONS.values(), 0.0)
        for metric in self._requests.collect():
            for sample in metric.samples:
                reason = _FINISHED_REASONS.get(sample.labels.get("outcome", ""))
                if sample.name.endswith("_total") and reason is not None:
                    counts[reason] += sample.value
        return self._f.labelled(
            CounterMetricFamily,
            "vllm:request_success",
            "Requests that finished, by finished_reason.",
            "finished_reason",
            counts,
        )


def _renamed(histogram: Any, name: str) -> Iterator[Metric]:
    """The histogram's families under `name` (samples renamed, labels and values as they are)."""
    for metric in histogram.collect():
        copy = Metric(name, metric.documentation, metric.type)
        copy.samples = [
            sample._replace(name=name + sample.name.removeprefix(metric.name))
            for sample in metric.samples
        ]
        yield copy
