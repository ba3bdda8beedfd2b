"""Prometheus metrics of one server: its own CollectorRegistry, served on the metrics port."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sloserve.frontend.failures import FailureCode
from sloserve.frontend.requests import Finished

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Request outcomes and latencies (observed by the front end) plus live engine gauges (at scrape)."""

    def __init__(self, engine_stats: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("sloserve_requests", "Requests by outcome (finish reason or status).",
                                ["outcome"], registry=self.registry)
        self.ttft = Histogram("sloserve_ttft_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("sloserve_tpot_seconds", "Mean time per output token after the first.",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("sloserve_e2e_seconds", "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.service_refusals: collections.Counter[str] = collections.Counter()
        if engine_stats is not None:
            self.registry.register(_EngineCollector(engine_stats, self.service_refusals))
        self._http: Any = None

    def request_done(self, outcome: str, finished: Finished | None = None) -> None:
        """Count a request that ended; observe its latencies (from its arrival stamp) when it ran."""
        self.requests.labels(outcome=outcome).inc()
        if finished is None:
            return
        if finished.ttft_s is not None:
            self.ttft.observe(finished.ttft_s)
            if finished.completion_tokens > 1:
                self.tpot.observe(max(0.0, finished.e2e_s - finished.ttft_s) / (finished.completion_tokens - 1))
        self.e2e.observe(finished.e2e_s)

    def request_failed(self, code: FailureCode, reason: str) -> None:
        """Count a request that failed; refusals for the server's state are also counted by reason."""
        self.requests.labels(outcome=code.value).inc()
        if code == FailureCode.UNAVAILABLE and reason in ("draining", "not_ready"):
            self.service_refusals[reason] += 1

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP in a daemon thread; returns the bound port (port 0 picks one)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _EngineCollector(Collector):
    """Reads engine.stats() at scrape time, so gauges are never stale."""

    def __init__(self, engine_stats: Callable[[], Any], service_refusals: collections.Counter[str]) -> None:
        self._stats = engine_stats
        self._service_refusals = service_refusals

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - an engine not yet started has no stats to report
            return
        yield GaugeMetricFamily("sloserve_waiting_requests", "Requests waiting to be scheduled.", value=s.waiting)
        yield GaugeMetricFamily("sloserve_running_requests", "Requests in the running batch.", value=s.running)
        yield GaugeMetricFamily("sloserve_kv_blocks_total", "KV cache blocks in the pool.", value=s.kv_blocks_total)
        yield GaugeMetricFamily("sloserve_kv_blocks_in_use", "KV cache blocks held by requests.",
                                value=s.kv_blocks_total - s.kv_blocks_free)
        yield GaugeMetricFamily("sloserve_kv_blocks_cached", "Free KV blocks that still hold a reusable prefix.",
                                value=s.kv_blocks_cached)
        rate = s.prefix_hit_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0
        yield GaugeMetricFamily("sloserve_prefix_hit_rate", "Prompt tokens served from the prefix cache / all prompt tokens.",
                                value=rate)
        yield CounterMetricFamily("sloserve_prompt_tokens", "Prompt tokens received.", value=s.prompt_tokens_total)
        yield CounterMetricFamily("sloserve_prefix_hit_tokens", "Prompt tokens whose KV was reused.",
                                  value=s.prefix_hit_tokens_total)
        yield CounterMetricFamily("sloserve_generated_tokens", "Tokens generated.", value=s.generated_tokens_total)
        yield CounterMetricFamily("sloserve_preemptions", "Running requests preempted.", value=s.preemptions_total)
        refusals = CounterMetricFamily("sloserve_refusals", "Requests refused, by reason.", labels=["reason"])
        merged = collections.Counter({str(k): int(v) for k, v in (s.refusals or {}).items()})
        merged.update(self._service_refusals)
        for reason, count in sorted(merged.items()):
            refusals.add_metric([reason], count)
        yield refusals
        yield GaugeMetricFamily("sloserve_step_time_seconds", "Mean engine step time over recent steps.",
                                value=s.step_time_s)
