"""Objectives assigned by rules on request lengths: --slo-rule and the YAML file."""

from __future__ import annotations

import pytest
from sloserve.bench.slo_rules import apply_rules, load_rules_file, parse_rule
from sloserve.bench.workloads import WorkloadItem
from sloserve.sampling_params import SLO


def test_the_first_matching_rule_wins():
    rules = [
        parse_rule("gen>250:e2e=20,class=batch,priority=1"),
        parse_rule("prompt>=100&gen<=250:ttft=2,tpot=0.1"),
        parse_rule("default:ttft=0.5,tpot=0.06,class=interactive,priority=0"),
    ]
    items = [WorkloadItem("x" * 10, 300), WorkloadItem("x" * 100, 250), WorkloadItem("x" * 99, 250)]
    long, big_prompt, short = apply_rules(rules, items)
    assert (long.slo, long.slo_class, long.priority) == (SLO(e2e_s=20.0), "batch", 1)
    assert (big_prompt.slo, big_prompt.slo_class, big_prompt.priority) == (
        SLO(ttft_s=2.0, tpot_s=0.1),
        None,
        None,
    )
    assert (short.slo, short.slo_class, short.priority) == (
        SLO(ttft_s=0.5, tpot_s=0.06),
        "interactive",
        0,
    )


def test_lengths_given_override_the_items_and_unmatched_items_keep_their_own():
    own = SLO(e2e_s=99.0)
    items = [WorkloadItem("x", 1, slo=own), WorkloadItem("x", 1)]
    out = apply_rules([parse_rule("gen>250:e2e=20")], items, lengths=[(5, 10), (5, 500)])
    assert out[0].slo == own and out[1].slo == SLO(e2e_s=20.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gen>250", "use CONDITION:SETTINGS"),
        ("gen>>250:e2e=1", "cannot read condition 'gen>>250'"),
        ("tokens>5:e2e=1", "cannot read condition 'tokens>5'"),
        ("default:e2e", "cannot read setting 'e2e'"),
        ("default:e2e=-1", "e2e must be a number of seconds > 0"),
        ("default:ttft=fast", "ttft must be a number of seconds > 0"),
        ("default:speed=1", "unknown setting speed"),
        ("default:priority=high", "priority must be an integer"),
    ],
)
def test_bad_rules_say_what_to_change(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rule(text)


def test_rules_from_yaml(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(
        "- {when: 'gen>250', e2e: 20, class: batch, priority: 1}\n- {ttft: 0.5, tpot: 0.06}\n"
    )
    rules = load_rules_file(path)
    assert [r.conditions for r in rules] == [(("gen", ">", 250),), ()]
    assert rules[1].slo == SLO(ttft_s=0.5, tpot_s=0.06) and rules[0].priority == 1
    path.write_text("when: default\n")
    with pytest.raises(ValueError, match="non-empty list"):
        load_rules_file(path)
    path.write_text("- {when: 'gen>1', color: red}\n")
    with pytest.raises(ValueError, match="rule 1: unknown setting color"):
        load_rules_file(path)
