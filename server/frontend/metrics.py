"""Prometheus metrics of one server: its own CollectorRegistry, served on the metrics port.

Besides outcomes, latencies and engine gauges:

- ``sloserve_slo_requests_total{slo_class, outcome}``: every request the front end ran, by the
  class of its objectives (``interactive``: a TTFT or TPOT objective; ``batch``: only an
  end-to-end one, which a gRPC deadline or HTTP timeout also sets; ``none``) and by outcome:
  ``met`` (it finished and every objective held, judged from the server's own timings, counted
  from arrival), ``missed`` (it finished late, or was cancelled before it finished), ``refused``
  (admission refused it for load or because its deadline passed) or ``failed`` (any other
  failure). Attainment of a class is met / all. Requests an edge rejected before running them
  (bad input, draining, not ready) are counted only in ``sloserve_requests``.
- ``sloserve_ttft_prediction_error_seconds{quantile="0.5"|"0.9"}``: admission's predicted minus
  actual time to first token over recent requests (positive: the token came sooner than
  predicted), and ``sloserve_ttft_predictions``, the admitted requests whose prediction could
  be checked.
- Mixture-of-experts models only: ``sloserve_expert_resident{moe_layer}`` (experts on the device
  per MoE layer), ``sloserve_expert_hits_total`` / ``_misses_total`` and ``sloserve_expert_hit_rate``,
  ``sloserve_expert_prefetches_total``, ``sloserve_expert_prefetch_accuracy`` and
  ``sloserve_expert_prediction_recall``, ``sloserve_expert_copied_bytes_total`` and
  ``sloserve_expert_copied_bytes_per_step``, ``sloserve_expert_miss_stall_seconds_total``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sloserve.frontend.failures import FailureCode
from sloserve.frontend.requests import Finished, ParsedRequest
from sloserve.sampling_params import SLO

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SLO_CLASSES = ("interactive", "batch", "none")
SLO_OUTCOMES = ("met", "missed", "refused", "failed")
_REFUSED = (FailureCode.RESOURCE_EXHAUSTED, FailureCode.DEADLINE_EXCEEDED)  # admission's refusal codes


def slo_class(slo: SLO | None) -> str:
    """The bounded label of a request's objectives: interactive, batch or none."""
    if slo is None or (slo.ttft_s is None and slo.tpot_s is None and slo.e2e_s is None):
        return "none"
    return "interactive" if slo.ttft_s is not None or slo.tpot_s is not None else "batch"


def slo_outcome(slo: SLO | None, finished: Finished) -> str:
    """met or missed: a request that ran to 'stop' or 'length', judged by its server-side timings."""
    if finished.finish_reason not in ("stop", "length"):
        return "missed"  # cancelled: it never completed
    if slo is None:
        return "met"
    tpot = 0.0  # one token (or none): no time per token to judge
    if finished.ttft_s is not None and finished.completion_tokens > 1:
        tpot = max(0.0, finished.e2e_s - finished.ttft_s) / (finished.completion_tokens - 1)
    ttft = finished.ttft_s if finished.completion_tokens else finished.e2e_s  # no token (max_tokens 0): its answer
    checks = ((slo.ttft_s, ttft), (slo.tpot_s, tpot), (slo.e2e_s, finished.e2e_s))
    met = all(limit is None or (value is not None and value <= limit) for limit, value in checks)
    return "met" if met else "missed"


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
        self.slo_requests = Counter("sloserve_slo_requests", "Requests the front end ran, by the class of "
                                    "their objectives (interactive, batch, none) and outcome "
                                    "(met, missed, refused, failed).", ["slo_class", "outcome"],
                                    registry=self.registry)
        for label in SLO_CLASSES:  # every series from the start, so rates need no first sample
            for outcome in SLO_OUTCOMES:
                self.slo_requests.labels(slo_class=label, outcome=outcome)
        self.service_refusals: collections.Counter[str] = collections.Counter()
        if engine_stats is not None:
            self.registry.register(_EngineCollector(engine_stats, self.service_refusals))
        self._http: Any = None

    def request_done(self, outcome: str, finished: Finished | None = None,
                     request: ParsedRequest | None = None) -> None:
        """Count a request that ended; observe its latencies (from its arrival stamp) when it ran.

        `request`: the request the front end ran, whose objectives class it in sloserve_slo_requests.
        """
        self.requests.labels(outcome=outcome).inc()
        if request is not None:
            judged = slo_outcome(request.slo, finished) if finished is not None else "missed"
            self.slo_requests.labels(slo_class=slo_class(request.slo), outcome=judged).inc()
        if finished is None:
            return
        if finished.ttft_s is not None:
            self.ttft.observe(finished.ttft_s)
            if finished.completion_tokens > 1:
                self.tpot.observe(max(0.0, finished.e2e_s - finished.ttft_s) / (finished.completion_tokens - 1))
        self.e2e.observe(finished.e2e_s)

    def request_failed(self, code: FailureCode, reason: str, request: ParsedRequest | None = None) -> None:
        """Count a request that failed; refusals for the server's state are also counted by reason.

        `request`: the request the front end ran, whose objectives class it in sloserve_slo_requests.
        """
        self.requests.labels(outcome=code.value).inc()
        if request is not None:
            self.slo_requests.labels(slo_class=slo_class(request.slo),
                                     outcome="refused" if code in _REFUSED else "failed").inc()
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
        yield CounterMetricFamily("sloserve_engine_steps", "Model steps the engine ran (a run of n decode steps "
                                  "counts n), warm-up excluded.", value=getattr(s, "steps_total", 0))
        yield CounterMetricFamily("sloserve_engine_busy_seconds", "Wall time the runner spent on those steps.",
                                  value=getattr(s, "busy_seconds_total", 0.0))
        yield CounterMetricFamily("sloserve_computed_prompt_tokens", "Prompt tokens the engine computed "
                                  "(prefix-cache hits excluded, recomputes after preemption included).",
                                  value=getattr(s, "computed_prompt_tokens_total", 0))
        error = GaugeMetricFamily("sloserve_ttft_prediction_error_seconds",
                                  "Admission's predicted minus actual time to first token, over recent requests.",
                                  labels=["quantile"])
        error.add_metric(["0.5"], getattr(s, "ttft_prediction_error_p50_s", 0.0))
        error.add_metric(["0.9"], getattr(s, "ttft_prediction_error_p90_s", 0.0))
        yield error
        yield CounterMetricFamily("sloserve_ttft_predictions",
                                  "Admitted requests whose predicted time to first token was checked.",
                                  value=getattr(s, "ttft_predictions", 0))
        yield from _expert_metrics(s)


def _expert_metrics(s: Any) -> Iterator[Any]:
    """The expert cache's gauges and counters; nothing for a dense model."""
    resident_per_layer = getattr(s, "expert_resident_per_layer", None)
    if not resident_per_layer:
        return
    resident = GaugeMetricFamily("sloserve_expert_resident", "Routed experts on the device, per MoE layer.",
                                 labels=["moe_layer"])
    for layer, count in enumerate(resident_per_layer):
        resident.add_metric([str(layer)], count)
    yield resident
    yield CounterMetricFamily("sloserve_expert_hits", "Expert uses (one expert, one MoE layer, one step) "
                              "whose weights were already on the device.", value=s.expert_hits_total)
    yield CounterMetricFamily("sloserve_expert_misses", "Expert uses that waited for a copy from host memory.",
                              value=s.expert_misses_total)
    yield GaugeMetricFamily("sloserve_expert_hit_rate", "Expert hits / (hits + misses) since warm-up.",
                            value=s.expert_hit_rate)
    yield CounterMetricFamily("sloserve_expert_prefetches", "Experts copied in ahead of their layer.",
                              value=s.expert_prefetches_total)
    yield GaugeMetricFamily("sloserve_expert_prefetch_accuracy", "Share of prefetched experts their layer used.",
                            value=s.expert_prefetch_accuracy)
    yield GaugeMetricFamily("sloserve_expert_prediction_recall",
                            "Share of the experts layers used that the prediction named.",
                            value=s.expert_prediction_recall)
    yield CounterMetricFamily("sloserve_expert_copied_bytes", "Expert bytes copied from host to device memory.",
                              value=s.expert_bytes_copied_total)
    yield GaugeMetricFamily("sloserve_expert_copied_bytes_per_step",
                            "Expert bytes copied per engine step (mean of the last 64 steps).",
                            value=s.expert_bytes_per_step)
    yield CounterMetricFamily("sloserve_expert_miss_stall_seconds", "Time spent waiting for expert copies on misses.",
                              value=s.expert_miss_stall_s_total)
