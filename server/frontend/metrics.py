"""Prometheus metrics of one server: its own CollectorRegistry, served on the metrics port.

Every series carries a ``model_name`` label (the served model name); no ``_created`` series.
Besides outcomes, latencies (TTFT, TPOT, end-to-end, queue time, inter-token latency) and engine
gauges (among them ``sloserve_kv_cache_usage_ratio``, 0-1):

- ``sloserve_slo_requests_total{slo_class, outcome}``: every request the front end ran, by the
  class of its objectives (``interactive``: a TTFT or TPOT objective; ``batch``: only an
  end-to-end one, which a gRPC deadline or HTTP timeout also sets; ``none``) and by outcome:
  ``met`` (it finished and every objective held, judged from the server's own timings, counted
  from arrival), ``missed`` (it finished late, or was cancelled before it finished), ``refused``
  (admission refused it for load or because its deadline passed), ``failed`` (any other
  failure) or, for class ``none`` only, ``unjudged`` (it ended with no objective to meet).
  Attainment of a class is met / all. Requests an edge rejected before running them (bad input,
  draining, not ready) are counted only in ``sloserve_requests``.
- ``sloserve_limit_refusals_total{limit}``: requests, messages, streams and connections refused
  by one of the server's input limits (``max_tokens``, ``grpc_max_streams``, ...), by limit.
- ``sloserve_inter_token_latency_seconds``: the wait between deliveries of tokens after the
  first, per token (a delivery of n tokens counts n waits of 1/n of it).
- ``sloserve_weight_resident_bytes``: bytes every weight of the loaded model holds, each once, in
  the form its kernel reads (``weight_resident_bytes`` of ``sloserve info``); absent until loaded.
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
import ssl
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from sloserve.frontend import metrics_http
from sloserve.frontend.engine_metrics import EngineCollector
from sloserve.frontend.failures import FailureCode
from sloserve.frontend.requests import Finished, ParsedRequest
from sloserve.frontend.vllm_metrics import VllmCollector
from sloserve.sampling_params import SLO

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SLO_CLASSES = ("interactive", "batch", "none")
SLO_OUTCOMES = ("met", "missed", "refused", "failed", "unjudged")
_REFUSED = (
    FailureCode.RESOURCE_EXHAUSTED,
    FailureCode.DEADLINE_EXCEEDED,
)  # admission's refusal codes
METRICS_COMPAT = ("none", "vllm")


def slo_outcomes(label: str) -> tuple[str, ...]:
    """The outcomes a class can have: only a request without objectives is `unjudged`, and never met or missed."""
    return (
        ("unjudged", "refused", "failed")
        if label == "none"
        else ("met", "missed", "refused", "failed")
    )


def slo_class(slo: SLO | None) -> str:
    """The bounded label of a request's objectives: interactive, batch or none."""
    if slo is None or (slo.ttft_s is None and slo.tpot_s is None and slo.e2e_s is None):
        return "none"
    return "interactive" if slo.ttft_s is not None or slo.tpot_s is not None else "batch"


def slo_outcome(slo: SLO | None, finished: Finished | None) -> str:
    """met or missed for a request that ran (None: it never finished), judged by its server-side timings;
    unjudged when it had no objective."""
    if slo_class(slo) == "none":
        return "unjudged"
    if finished is None or finished.finish_reason not in ("stop", "length"):
        return "missed"  # cancelled: it never completed
    tpot = 0.0  # one token (or none): no time per token to judge
    if finished.ttft_s is not None and finished.completion_tokens > 1:
        tpot = max(0.0, finished.e2e_s - finished.ttft_s) / (finished.completion_tokens - 1)
    # no token (max_tokens 0): its answer
    ttft = finished.ttft_s if finished.completion_tokens else finished.e2e_s
    checks = ((slo.ttft_s, ttft), (slo.tpot_s, tpot), (slo.e2e_s, finished.e2e_s))
    met = all(limit is None or (value is not None and value <= limit) for limit, value in checks)
    return "met" if met else "missed"


class Metrics:
    """Request outcomes and latencies (observed by the front end) plus live engine gauges (at scrape).

    `model_name` labels every series; `compat` "vllm" adds the vllm:-named series (vllm_metrics.py).
    """

    def __init__(
        self,
        engine_stats: Callable[[], Any] | None = None,
        *,
        engine_info: Callable[[], dict] | None = None,
        model_name: str = "default",
        compat: str = "none",
    ) -> None:
        if compat not in METRICS_COMPAT:
            raise ValueError(
                f"metrics compat must be one of {', '.join(METRICS_COMPAT)}, got {compat!r}"
            )
        disable_created_metrics()  # NOTE: process-wide; no series of sloserve's needs a _created twin
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.requests = Counter(
            "sloserve_requests",
            "Requests by outcome (finish reason or status).",
            [*m, "outcome"],
            registry=r,
        )
        self.histograms = {
            "ttft": Histogram(
                "sloserve_ttft_seconds",
                "Time from arrival to the first token.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            "tpot": Histogram(
                "sloserve_tpot_seconds",
                "Mean time per output token after the first.",
                m,
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            "itl": Histogram(
                "sloserve_inter_token_latency_seconds",
                "Wait between token deliveries after the "
                "first, per token (n tokens delivered together: n waits of 1/n).",
                m,
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            "e2e": Histogram(
                "sloserve_e2e_seconds",
                "Time from arrival to the last token.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            "queue": Histogram(
                "sloserve_queue_seconds",
                "Time from arrival to the first scheduled step.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
        }
        self.ttft, self.tpot, self.itl, self.e2e, self.queue = (
            h.labels(model_name) for h in self.histograms.values()
        )
        self.slo_requests = Counter(
            "sloserve_slo_requests",
            "Requests the front end ran, by the class of "
            "their objectives (interactive, batch, none) and outcome "
            "(met, missed, refused, failed; unjudged: no objective).",
            [*m, "slo_class", "outcome"],
            registry=r,
        )
        for label in SLO_CLASSES:  # every series from the start, so rates need no first sample
            for outcome in slo_outcomes(label):
                self.slo_requests.labels(model_name, label, outcome)
        self.limit_refusals = Counter(
            "sloserve_limit_refusals",
            "Requests, messages, streams and connections "
            "refused by one of the server's input limits, by limit.",
            [*m, "limit"],
            registry=r,
        )
        self.service_refusals: collections.Counter[str] = collections.Counter()
        if engine_stats is not None:
            r.register(
                EngineCollector(engine_stats, self.service_refusals, model_name, engine_info)
            )
        if compat == "vllm":
            h = self.histograms
            r.register(
                VllmCollector(
                    engine_stats or _no_stats,
                    model_name,
                    requests=self.requests,
                    histograms={
                        "vllm:time_to_first_token_seconds": h["ttft"],
                        "vllm:time_per_output_token_seconds": h["itl"],
                        "vllm:inter_token_latency_seconds": h["itl"],
                        "vllm:e2e_request_latency_seconds": h["e2e"],
                        "vllm:request_queue_time_seconds": h["queue"],
                    },
                )
            )
        self._http: Any = None

    def limit_refused(self, limit: str) -> None:
        """Count one refusal by the input limit named `limit` (a bounded name such as http_header_timeout)."""
        self.limit_refusals.labels(self.model_name, limit).inc()

    def tokens_delivered(self, wait_s: float, count: int) -> None:
        """`count` tokens delivered together `wait_s` after the previous delivery (not the first one)."""
        if count > 0:
            per_token = max(0.0, wait_s) / count
            for _ in range(count):
                self.itl.observe(per_token)

    def request_done(
        self, outcome: str, finished: Finished | None = None, request: ParsedRequest | None = None
    ) -> None:
        """Count a request that ended; observe its latencies (from its arrival stamp) when it ran.

        `request`: the request the front end ran, whose objectives class it in sloserve_slo_requests.
        """
        self.requests.labels(self.model_name, outcome).inc()
        if request is not None:
            self.slo_requests.labels(
                self.model_name, slo_class(request.slo), slo_outcome(request.slo, finished)
            ).inc()
        if finished is None:
            return
        if finished.ttft_s is not None:
            self.ttft.observe(finished.ttft_s)
            if finished.completion_tokens > 1:
                self.tpot.observe(
                    max(0.0, finished.e2e_s - finished.ttft_s) / (finished.completion_tokens - 1)
                )
        if finished.queue_s is not None:
            self.queue.observe(finished.queue_s)
        self.e2e.observe(finished.e2e_s)

    def request_failed(
        self, code: FailureCode, reason: str, request: ParsedRequest | None = None
    ) -> None:
        """Count a request that failed; refusals for the server's state are also counted by reason.

        `request`: the request the front end ran, whose objectives class it in sloserve_slo_requests.
        """
        self.requests.labels(self.model_name, code.value).inc()
        if request is not None:
            label = slo_class(request.slo)
            outcome = "refused" if code in _REFUSED else "failed"
            self.slo_requests.labels(self.model_name, label, outcome).inc()
        if code == FailureCode.UNAVAILABLE and reason in ("draining", "not_ready"):
            self.service_refusals[reason] += 1

    def serve(
        self,
        port: int,
        host: str = "127.0.0.1",
        *,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> int:
        """Serve /metrics in a daemon thread (HTTPS with `tls`, a bearer `token` required if given);
        returns the bound port (port 0 picks one)."""
        self._http = metrics_http.serve(self.registry, host, port, tls=tls, token=token)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _no_stats() -> Any:
    raise RuntimeError("no engine stats")
