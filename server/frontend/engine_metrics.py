"""The engine's gauges and counters, read from engine.stats() at scrape time (so never stale)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


def kv_cache_usage(stats: Any) -> float:
    """Share of the KV pool's blocks held by requests, 0-1 (free blocks that cache a prefix count as free)."""
    total = stats.kv_blocks_total
    return (total - stats.kv_blocks_free) / total if total else 0.0


class Families:
    """Metric families that carry the server's `model_name` label first."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def labelled(
        self, kind: type, name: str, doc: str, label: str, values: dict[str, float]
    ) -> GaugeMetricFamily | CounterMetricFamily:
        """One series per key of `values`, labelled `label`."""
        family = kind(name, doc, labels=["model_name", label])
        for key, value in values.items():
            family.add_metric([self.model_name, key], value)
        return family


class EngineCollector(Collector):
    """Reads engine.stats() (and model_info) at scrape time; `service_refusals` adds the front end's own refusals."""

    def __init__(
        self,
        engine_stats: Callable[[], Any],
        service_refusals: collections.Counter[str],
        model_name: str,
        engine_info: Callable[[], dict] | None = None,
    ) -> None:
        self._stats = engine_stats
        self._info = engine_info
        self._service_refusals = service_refusals
        self._f = Families(model_name)

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - an engine not yet started has no stats to report
            return
        f = self._f
        yield f.gauge("sloserve_waiting_requests", "Requests waiting to be scheduled.", s.waiting)
        yield f.gauge("sloserve_running_requests", "Requests in the running batch.", s.running)
        yield f.gauge("sloserve_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield f.gauge(
            "sloserve_kv_blocks_in_use",
            "KV cache blocks held by requests.",
            s.kv_blocks_total - s.kv_blocks_free,
        )
        yield f.gauge(
            "sloserve_kv_blocks_cached",
            "Free KV blocks that still hold a reusable prefix.",
            s.kv_blocks_cached,
        )
        yield f.gauge(
            "sloserve_kv_cache_usage_ratio",
            "Share of KV cache blocks held by requests (0-1).",
            kv_cache_usage(s),
        )
        rate = s.prefix_hit_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0
        yield f.gauge(
            "sloserve_prefix_hit_rate",
            "Prompt tokens served from the prefix cache / all prompt tokens.",
            rate,
        )
        yield f.counter("sloserve_prompt_tokens", "Prompt tokens received.", s.prompt_tokens_total)
        yield f.counter(
            "sloserve_prefix_hit_tokens",
            "Prompt tokens whose KV was reused.",
            s.prefix_hit_tokens_total,
        )
        yield f.counter("sloserve_generated_tokens", "Tokens generated.", s.generated_tokens_total)
        yield f.counter("sloserve_preemptions", "Running requests preempted.", s.preemptions_total)
        yield f.counter(
            "sloserve_spec_decode_num_drafts",
            "Speculative decoding: verify steps, one per sequence with draft tokens (vLLM's name).",
            getattr(s, "spec_drafts_total", 0),
        )
        yield f.counter(
            "sloserve_spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            getattr(s, "spec_drafted_tokens_total", 0),
        )
        yield f.counter(
            "sloserve_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens the model accepted.",
            getattr(s, "spec_accepted_tokens_total", 0),
        )
        merged = collections.Counter({str(k): int(v) for k, v in (s.refusals or {}).items()})
        merged.update(self._service_refusals)
        yield f.labelled(
            CounterMetricFamily,
            "sloserve_refusals",
            "Requests refused, by reason.",
            "reason",
            dict(sorted(merged.items())),
        )
        yield f.gauge(
            "sloserve_step_time_seconds", "Mean engine step time over recent steps.", s.step_time_s
        )
        yield f.counter(
            "sloserve_engine_steps",
            "Model steps the engine ran (a run of n decode steps counts n), warm-up excluded.",
            getattr(s, "steps_total", 0),
        )
        yield f.counter(
            "sloserve_engine_busy_seconds",
            "Wall time the runner spent on those steps.",
            getattr(s, "busy_seconds_total", 0.0),
        )
        yield f.counter(
            "sloserve_computed_prompt_tokens",
            "Prompt tokens the engine computed (prefix-cache hits "
            "excluded, recomputes after preemption included).",
            getattr(s, "computed_prompt_tokens_total", 0),
        )
        yield f.labelled(
            GaugeMetricFamily,
            "sloserve_ttft_prediction_error_seconds",
            "Admission's predicted minus actual time to first token, over recent requests.",
            "quantile",
            {
                "0.5": getattr(s, "ttft_prediction_error_p50_s", 0.0),
                "0.9": getattr(s, "ttft_prediction_error_p90_s", 0.0),
            },
        )
        yield f.counter(
            "sloserve_ttft_predictions",
            "Admitted requests whose predicted time to first token was checked.",
            getattr(s, "ttft_predictions", 0),
        )
        yield from _expert_metrics(f, s)
        yield from _lora_metrics(f, s)
        yield from self._weight_metrics()

    def _weight_metrics(self) -> Iterator[Any]:
        """The resident weight bytes, once the engine's model_info says them."""
        try:
            held = (self._info() if self._info is not None else {}).get("weight_resident_bytes")
        except Exception:  # noqa: BLE001 - an engine not yet started has no model_info
            return
        if held is not None:
            yield self._f.gauge(
                "sloserve_weight_resident_bytes",
                "Bytes the model's weights hold, each once, in the form its kernels read.",
                held,
            )


def _lora_metrics(f: Families, s: Any) -> Iterator[Any]:
    """The LoRA adapters' gauges and counters; per-adapter series only for adapters loaded now."""
    yield f.gauge(
        "sloserve_lora_adapters_loaded",
        "LoRA adapters taking requests.",
        getattr(s, "lora_adapters_loaded", 0),
    )
    yield f.gauge(
        "sloserve_lora_adapter_bytes",
        "Bytes the loaded adapters' tensors hold.",
        getattr(s, "lora_adapter_bytes", 0),
    )
    yield f.counter("sloserve_lora_loads", "Adapter loads.", getattr(s, "lora_loads_total", 0))
    yield f.counter(
        "sloserve_lora_unloads", "Adapter unloads.", getattr(s, "lora_unloads_total", 0)
    )
    yield f.labelled(
        CounterMetricFamily,
        "sloserve_lora_requests",
        "Requests admitted per loaded adapter, since its load.",
        "adapter",
        dict(getattr(s, "lora_requests", None) or {}),
    )
    yield f.labelled(
        CounterMetricFamily,
        "sloserve_lora_generated_tokens",
        "Tokens generated per loaded adapter, since its load.",
        "adapter",
        dict(getattr(s, "lora_generated_tokens", None) or {}),
    )


def _expert_metrics(f: Families, s: Any) -> Iterator[Any]:
    """The expert cache's gauges and counters; nothing for a dense model."""
    resident_per_layer = getattr(s, "expert_resident_per_layer", None)
    if not resident_per_layer:
        return
    yield f.labelled(
        GaugeMetricFamily,
        "sloserve_expert_resident",
        "Routed experts on the device, per MoE layer.",
        "moe_layer",
        {str(layer): count for layer, count in enumerate(resident_per_layer)},
    )
    yield f.counter(
        "sloserve_expert_hits",
        "Expert uses (one expert, one MoE layer, one step) whose weights were "
        "already on the device.",
        s.expert_hits_total,
    )
    yield f.counter(
        "sloserve_expert_misses",
        "Expert uses that waited for a copy from host memory.",
        s.expert_misses_total,
    )
    yield f.gauge(
        "sloserve_expert_hit_rate",
        "Expert hits / (hits + misses) since warm-up.",
        s.expert_hit_rate,
    )
    yield f.counter(
        "sloserve_expert_prefetches",
        "Experts copied in ahead of their layer.",
        s.expert_prefetches_total,
    )
    yield f.gauge(
        "sloserve_expert_prefetch_accuracy",
        "Share of prefetched experts their layer used.",
        s.expert_prefetch_accuracy,
    )
    yield f.gauge(
        "sloserve_expert_prediction_recall",
        "Share of the experts layers used that the prediction named.",
        s.expert_prediction_recall,
    )
    yield f.counter(
        "sloserve_expert_copied_bytes",
        "Expert bytes copied from host to device memory.",
        s.expert_bytes_copied_total,
    )
    yield f.gauge(
        "sloserve_expert_copied_bytes_per_step",
        "Expert bytes copied per engine step (mean of the last 64 steps).",
        s.expert_bytes_per_step,
    )
    yield f.counter(
        "sloserve_expert_miss_stall_seconds",
        "Time spent waiting for expert copies on misses.",
        s.expert_miss_stall_s_total,
    )
