"""Read one sample from a Prometheus text exposition, whatever other labels (model_name) it carries."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the first sample called `name` whose labels include `labels` (0.0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def sample_spec(text: str, spec: str) -> float:
    """`sample` for a spec written as in the exposition: 'name' or 'name{label="value",...}'."""
    name, _, rest = spec.partition("{")
    labels = (
        dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part) if rest else {}
    )
    return sample(text, name, **{k: v.strip('"') for k, v in labels.items()})
