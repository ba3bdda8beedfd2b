"""Workload specs: ARC serialisation, JSONL traces, synthetic ARC shape, fixed sizes, bad input."""

from __future__ import annotations

import json
import statistics

import pytest
from sloserve.bench.workloads import ARC_TRACE, WorkloadItem, load_workload

TASK = {
    "train": [
        {"input": [[7, 9], [4, 3]], "output": [[7, 9, 7], [4, 3, 4]]},
        {"input": [[0]], "output": [[5, 5]]},
    ],
    "test": [{"input": [[1, 2]], "output": [[1, 2, 1]]}, {"input": [[3], [8]]}],
}
SHARED = "Input:\n79\n43\nOutput:\n797\n434\n\nInput:\n0\nOutput:\n55\n\n"


@pytest.fixture
def arc_dir(tmp_path):
    (tmp_path / "abc123.json").write_text(json.dumps(TASK))
    return tmp_path


def test_arc_folder_serialises_as_the_trace(arc_dir):
    items = load_workload(f"arc:{arc_dir}", attempts=2)
    assert [i.prompt for i in items] == [SHARED + "Input:\n12\nOutput:\n"] * 2 + [
        SHARED + "Input:\n3\n8\nOutput:\n"
    ] * 2
    assert [i.expected_output for i in items] == ["121\n", "121\n", None, None]
    # the answer and EOS
    assert items[0].max_tokens == 4 + 1 and all(i.group == "abc123" for i in items)


def test_attempts_and_num_requests_cycle(arc_dir):
    assert len(load_workload(f"arc:{arc_dir}", attempts=3)) == 6
    items = load_workload(f"arc:{arc_dir}", attempts=1, num_requests=5)
    assert len(items) == 5 and items[2] == items[0] and items[3] == items[1]


@pytest.mark.skipif(not ARC_TRACE.is_file(), reason="ARC-AGI-2 data not on this machine")
def test_arc_folder_matches_train_trace_exactly():
    trace = load_workload(f"jsonl:{ARC_TRACE}", seed=3)
    folder = load_workload(f"arc:{ARC_TRACE.parent / 'training'}", seed=3, attempts=2)
    assert [(i.prompt, i.expected_output, i.group) for i in folder] == [
        (i.prompt, i.expected_output, i.group) for i in trace
    ]


def test_jsonl_fields_and_defaults(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"prompt": "a", "expected_output": "xyz"},
        {"prompt": "b", "max_tokens": 9, "slo": {"ttft_s": 0.5}},
        {"prompt": "c", "slo_e2e_s": 2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    items = sorted(load_workload(f"jsonl:{path}"), key=lambda i: i.prompt)
    assert [i.max_tokens for i in items] == [3 + 1, 9, 128]
    assert items[0].slo is None and items[1].slo.ttft_s == 0.5 and items[2].slo.e2e_s == 2.0


def test_groups_stay_together_and_seed_is_deterministic():
    a = load_workload("synthetic-arc", seed=1, num_requests=300)
    assert a == load_workload("synthetic-arc", seed=1, num_requests=300)
    assert a != load_workload("synthetic-arc", seed=2, num_requests=300)
    seen, last = set(), None
    for item in a:
        if item.group != last:
            assert item.group not in seen, "a group's items must be adjacent"
            seen.add(item.group)
            last = item.group


def test_synthetic_arc_follows_arc_shape():
    items = load_workload("synthetic-arc", seed=0, attempts=2)
    prompts = [len(i.prompt) for i in items[::2]]
    outputs = [len(i.expected_output) for i in items[::2]]
    assert 800 <= statistics.median(prompts) <= 1200
    assert 4500 <= statistics.quantiles(prompts, n=100)[98] <= 8500
    assert 70 <= statistics.median(outputs) <= 150
    # the two attempts share the whole prompt; test inputs of a task share the train pairs
    assert all(a.prompt == b.prompt for a, b in zip(items[::2], items[1::2], strict=True))
    by_group: dict[str, list[str]] = {}
    for item in items[::2]:
        by_group.setdefault(item.group, []).append(item.prompt)
    multi = [p for p in by_group.values() if len(p) > 1]
    assert multi and all(
        p[0].rsplit("Input:\n", 1)[0] == p[1].rsplit("Input:\n", 1)[0] for p in multi
    )


def test_fixed_workload():
    items = load_workload("fixed:20,7", num_requests=4)
    assert len(items) == 4 and all(len(i.prompt) == 20 and i.prompt.isdigit() for i in items)
    assert all(i.max_tokens == 7 and i.ignore_eos for i in items)
    assert isinstance(items[0], WorkloadItem)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown workload"),
        ("arc:/does/not/exist", "does not exist"),
        ("jsonl:/does/not/exist.jsonl", "cannot read"),
        ("fixed:10", "two integers"),
        ("fixed:0,5", ">= 1"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        load_workload(spec)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "x"}\nnot json\n', ":2: not valid JSON"),
        ('{"expected_output": "x"}\n', "non-empty 'prompt'"),
        ('{"prompt": "x", "max_tokens": 0}\n', "max_tokens"),
        ('{"prompt": "x", "slo": {"ttft_s": -1}}\n', "ttft_s"),
        ("", "holds no requests"),
    ],
)
def test_malformed_jsonl(tmp_path, content, message):
    path = tmp_path / "w.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_workload(f"jsonl:{path}")


def test_malformed_arc_task(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"train": [], "test": [{"input": [[1, 12]]}]}))
    with pytest.raises(ValueError, match="digits 0-9"):
        load_workload(f"arc:{tmp_path}")
    (tmp_path / "t.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read ARC task"):
        load_workload(f"arc:{tmp_path}")
