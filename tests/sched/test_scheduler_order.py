"""Scheduler ordering without torch: urgency, fifo, aging, the 200 ms promotion, chunk sizes."""

from __future__ import annotations

import pytest
from sloserve.config import SchedulerConfig
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.sched.queue_policy import make_queue

from tests.engine.fakes import reference_tokens
from tests.engine.helpers import drain, make_scheduler, step, tokens_of


def _admission_order(scheduler, runner) -> list[str]:
    order: list[str] = []
    while scheduler.has_work():
        out, _ = step(scheduler, runner)
        order += [s.req_id for s in out.sequences if s.start_pos == 0]
    return order


def _prompt(c: str, n: int = 6) -> list[int]:
    return [ord(c)] * n


@pytest.mark.parametrize(
    "policy, expected", [("slo", ["tight", "mid", "loose"]), ("fifo", ["loose", "tight", "mid"])]
)
def test_waiting_requests_start_in_policy_order(policy, expected):
    s, r, _ = make_scheduler(policy=policy, max_batch=1, adaptive_batch=False)
    params = SamplingParams(max_tokens=2)
    s.add_request(NewRequest("loose", _prompt("a"), params, SLO(ttft_s=5.0)))
    s.add_request(NewRequest("tight", _prompt("b"), params, SLO(ttft_s=0.5)))
    s.add_request(NewRequest("mid", _prompt("c"), params, SLO(ttft_s=1.0)))
    assert _admission_order(s, r) == expected


@pytest.mark.parametrize(
    "aging, expected", [(0.9, ["busy", "old", "new"]), (1.0, ["busy", "new", "old"])]
)
def test_aging_lets_a_long_waiting_request_overtake_a_tighter_newcomer(aging, expected):
    s, r, _ = make_scheduler(max_batch=1, adaptive_batch=False, aging=aging, max_wait_s=1e6)
    s.add_request(NewRequest("busy", _prompt("a"), SamplingParams(max_tokens=22)))
    step(s, r)
    s.add_request(NewRequest("old", _prompt("b"), SamplingParams(max_tokens=1), SLO(ttft_s=10.0)))
    order = ["busy"]
    for _ in range(19):  # 'old' ages while 'busy' decodes (the clock does not move)
        step(s, r)
    s.add_request(NewRequest("new", _prompt("c"), SamplingParams(max_tokens=1), SLO(ttft_s=3.0)))
    order += [x for x in _admission_order(s, r) if x != "busy"]
    assert order == expected


@pytest.mark.parametrize(
    "max_wait_s, expected", [(0.2, ["busy", "old", "new"]), (1.0, ["busy", "new", "old"])]
)
def test_a_request_waiting_past_max_wait_jumps_ahead(max_wait_s, expected):
    s, r, clock = make_scheduler(max_batch=1, adaptive_batch=False, max_wait_s=max_wait_s)
    s.add_request(NewRequest("busy", _prompt("a"), SamplingParams(max_tokens=4)))
    step(s, r)
    s.add_request(NewRequest("old", _prompt("b"), SamplingParams(max_tokens=1), SLO(ttft_s=10.0)))
    step(s, r)
    clock.t += 0.25
    s.add_request(NewRequest("new", _prompt("c"), SamplingParams(max_tokens=1), SLO(ttft_s=0.5)))
    assert ["busy"] + [x for x in _admission_order(s, r) if x != "busy"] == expected


def test_chunked_prefill_respects_token_budget_and_chunk_size():
    s, r, _ = make_scheduler(
        max_batched_tokens=10, prefill_chunk=6, max_batch=8, adaptive_batch=False
    )
    a, b = _prompt("a", 13), _prompt("b", 15)  # equal deadlines: the shorter prompt goes first
    s.add_request(NewRequest("A", a, SamplingParams(max_tokens=3)))
    s.add_request(NewRequest("B", b, SamplingParams(max_tokens=3)))
    chunks, outputs = [], {}
    while s.has_work():
        out, outs = step(s, r)
        if out.sequences:  # (a last empty step tells the executor which requests finished)
            chunks.append([(q.req_id, len(q.token_ids)) for q in out.sequences])
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert chunks == [
        [("A", 6), ("B", 4)],
        [("A", 6), ("B", 4)],
        [("A", 1), ("B", 6)],
        [("A", 1), ("B", 1)],
        [("A", 1), ("B", 1)],
        [("B", 1)],
    ]
    assert outputs == {"A": reference_tokens(r, a, 3), "B": reference_tokens(r, b, 3)}


def test_a_prompt_alone_fills_the_step_and_is_chunked_once_another_arrives():
    s, r, _ = make_scheduler(
        max_batched_tokens=40, prefill_chunk=6, max_batch=8, adaptive_batch=False
    )
    a, b = _prompt("a", 30), _prompt("b", 20)
    s.add_request(NewRequest("A", a, SamplingParams(max_tokens=2)))
    out, _ = step(s, r)
    # nobody's TPOT to keep
    assert [(q.req_id, len(q.token_ids)) for q in out.sequences] == [("A", 30)]
    s.add_request(NewRequest("B", b, SamplingParams(max_tokens=2)))
    out, _ = step(s, r)
    assert [(q.req_id, len(q.token_ids)) for q in out.sequences] == [("A", 1), ("B", 6)]
    s2, r2, _ = make_scheduler(
        max_batched_tokens=40, prefill_chunk=6, max_batch=8, adaptive_batch=False
    )
    s2.add_request(NewRequest("A", a, SamplingParams(max_tokens=2)))
    # waiting beside it: both chunked
    s2.add_request(NewRequest("B", b, SamplingParams(max_tokens=2)))
    out, _ = step(s2, r2)
    assert sorted((q.req_id, len(q.token_ids)) for q in out.sequences) == [("A", 6), ("B", 6)]


def test_without_chunking_a_prompt_runs_whole_and_an_oversized_one_runs_alone():
    s, r, _ = make_scheduler(
        policy="fifo",
        max_batched_tokens=10,
        chunked_prefill=False,
        max_batch=8,
        adaptive_batch=False,
    )
    s.add_request(NewRequest("A", _prompt("a", 15), SamplingParams(max_tokens=2)))
    s.add_request(NewRequest("B", _prompt("b", 9), SamplingParams(max_tokens=2)))
    chunks = []
    while s.has_work():
        out, _ = step(s, r)
        if out.sequences:  # (a last empty step tells the executor which requests finished)
            chunks.append([(q.req_id, len(q.token_ids)) for q in out.sequences])
    assert chunks == [[("A", 15)], [("A", 1), ("B", 9)], [("B", 1)]]


def test_adaptive_batch_target_limits_admission_by_queue_depth():
    # max_batch 8, decay 0.5: depth 1 -> ceil(8 * 0.5) = 4, depth 6 -> 8; with decay 0.99 and
    # 6 requests the target is ceil(8 * (1 - 0.99**6)) = 1.
    for decay, expected in [(0.5, 6), (0.99, 1)]:
        s, r, _ = make_scheduler(
            max_batch=8, batch_decay=decay, max_batched_tokens=512, adaptive_batch=True
        )
        for i in range(6):
            s.add_request(NewRequest(f"r{i}", _prompt(chr(97 + i)), SamplingParams(max_tokens=2)))
        out, _ = step(s, r)
        assert len(out.sequences) == expected


def test_running_requests_are_scheduled_before_waiting_ones():
    s, r, _ = make_scheduler(
        max_batched_tokens=8, prefill_chunk=8, max_batch=8, adaptive_batch=False
    )
    s.add_request(NewRequest("first", _prompt("a", 4), SamplingParams(max_tokens=5)))
    _, first_outputs = step(s, r)
    s.add_request(
        NewRequest("urgent", _prompt("b", 20), SamplingParams(max_tokens=1), SLO(ttft_s=0.01))
    )
    out, outputs = step(s, r)
    assert [(q.req_id, len(q.token_ids)) for q in out.sequences] == [("first", 1), ("urgent", 7)]
    got = tokens_of(first_outputs + outputs + drain(s, r)["first"])
    assert got == reference_tokens(r, _prompt("a", 4), 5)


def test_queue_factory_rejects_unknown_policy():
    config = SchedulerConfig()
    object.__setattr__(config, "policy", "lifo")
    with pytest.raises(ValueError, match="unknown scheduling policy .lifo.*slo, priority, fifo"):
        make_queue(config)
