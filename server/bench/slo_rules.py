"""Objectives assigned by rules on request lengths: ``--slo-rule 'gen>250:e2e=20,class=batch'``.

A rule is ``CONDITION:SETTINGS``. CONDITION is ``default`` (matches every request) or comparisons
on ``prompt`` (prompt tokens) and ``gen`` (tokens to generate) joined by ``&``, e.g.
``prompt>1000&gen<=50``; SETTINGS are ``ttft``, ``tpot``, ``e2e`` (seconds), ``class`` (the
report's class name) and ``priority`` (an integer; lower runs first under the priority policy).
The first rule that matches a request sets its objectives; a request no rule matches keeps its
own. A YAML file holds a list of mappings, each with ``when`` (a CONDITION, default ``default``)
and the settings as keys.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, replace
from pathlib import Path

from sloserve.bench.workloads import PRIORITY_RANGE, WorkloadItem
from sloserve.sampling_params import SLO

_COMPARE = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "=": operator.eq,
    "==": operator.eq,
}
_CONDITION = re.compile(r"^\s*(prompt|gen)\s*(>=|<=|==|>|<|=)\s*(\d+)\s*$")
OBJECTIVE_KEYS = ("ttft", "tpot", "e2e")
SETTING_KEYS = (*OBJECTIVE_KEYS, "class", "priority")


@dataclass(slots=True, frozen=True)
class SloRule:
    """Comparisons on (prompt, gen) lengths, and what a matching request gets."""

    text: str
    conditions: tuple[tuple[str, str, int], ...]  # (prompt|gen, operator, bound); () matches all
    slo: SLO | None
    slo_class: str | None = None
    priority: int | None = None

    def matches(self, prompt_tokens: int, gen_tokens: int) -> bool:
        lengths = {"prompt": prompt_tokens, "gen": gen_tokens}
        return all(_COMPARE[op](lengths[name], bound) for name, op, bound in self.conditions)


def _conditions(text: str, where: str) -> tuple[tuple[str, str, int], ...]:
    if text.strip() == "default":
        return ()
    out = []
    for part in text.split("&"):
        match = _CONDITION.match(part)
        if match is None:
            raise ValueError(
                f"{where}: cannot read condition {part.strip()!r}; use 'default' or comparisons "
                "such as gen>250 or prompt<=1000 joined by &"
            )
        out.append((match[1], match[2], int(match[3])))
    return tuple(out)


def _rule(text: str, condition: str, settings: dict, where: str) -> SloRule:
    if unknown := sorted(set(settings) - set(SETTING_KEYS)):
        raise ValueError(
            f"{where}: unknown setting {', '.join(unknown)}; use {', '.join(SETTING_KEYS)}"
        )
    objectives = {}
    for key in OBJECTIVE_KEYS:
        if key in settings:
            try:
                value = float(settings[key])
            except (TypeError, ValueError):
                value = float("nan")
            if not value > 0 or value == float("inf"):
                raise ValueError(
                    f"{where}: {key} must be a number of seconds > 0, got {settings[key]!r}"
                )
            objectives[f"{key}_s"] = value
    priority = settings.get("priority")
    if priority is not None:
        low, high = PRIORITY_RANGE
        try:
            priority = int(str(priority))
        except ValueError:
            priority = None
        if priority is None or not low <= priority <= high:
            raise ValueError(
                f"{where}: priority must be an integer in [{low}, {high}], got {settings['priority']!r}"
            )
    slo_class = settings.get("class")
    if slo_class is not None and not str(slo_class).strip():
        raise ValueError(f"{where}: class must be a non-empty name")
    if not objectives and slo_class is None and priority is None:
        raise ValueError(f"{where}: a rule needs at least one of {', '.join(SETTING_KEYS)}")
    return SloRule(
        text,
        _conditions(condition, where),
        SLO(**objectives) if objectives else None,
        None if slo_class is None else str(slo_class),
        priority,
    )


def parse_rule(text: str) -> SloRule:
    """One --slo-rule 'CONDITION:key=value,...'; ValueError says what to change."""
    where = f"--slo-rule {text!r}"
    condition, sep, body = text.partition(":")
    if not sep or not body.strip():
        raise ValueError(
            f"{where}: use CONDITION:SETTINGS, e.g. 'gen>250:e2e=20' or 'default:ttft=0.5,tpot=0.06'"
        )
    settings = {}
    for pair in body.split(","):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"{where}: cannot read setting {pair.strip()!r}; use key=value")
        settings[key.strip()] = value.strip()
    return _rule(text, condition, settings, where)


def load_rules_file(path: str | Path) -> list[SloRule]:
    """Rules from a YAML list of mappings ({when: CONDITION, ttft: ..., class: ...})."""
    try:
        import yaml
    except ImportError:
        raise ValueError(
            "reading a rules file needs PyYAML: pip install 'sloserve[bench]'"
        ) from None
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read SLO rules file {str(path)!r}: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(
            f"{path}: the rules file must hold a non-empty list of mappings with 'when' and settings"
        )
    rules = []
    for number, entry in enumerate(data, 1):
        where = f"{path}: rule {number}"
        if not isinstance(entry, dict):
            raise ValueError(
                f"{where}: each rule must be a mapping such as {{when: 'gen>250', e2e: 20}}"
            )
        settings = {k: v for k, v in entry.items() if k != "when"}
        rules.append(_rule(f"{where}", str(entry.get("when", "default")), settings, where))
    return rules


def apply_rules(
    rules: list[SloRule], items: list[WorkloadItem], lengths: list[tuple[int, int]] | None = None
) -> list[WorkloadItem]:
    """Each item with the first matching rule's objectives, class and priority.

    lengths: (prompt, gen) tokens per item to match on (a trace's own lengths); by default the
    prompt's characters and max_tokens.
    """
    if not rules:
        return items
    out = []
    for k, item in enumerate(items):
        prompt, gen = lengths[k] if lengths is not None else (len(item.prompt), item.max_tokens)
        rule = next((r for r in rules if r.matches(prompt, gen)), None)
        if rule is None:
            out.append(item)
            continue
        out.append(
            replace(
                item,
                slo=rule.slo or item.slo,
                slo_class=rule.slo_class or item.slo_class,
                priority=rule.priority if rule.priority is not None else item.priority,
            )
        )
    return out
