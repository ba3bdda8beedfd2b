"""Stop conditions, streamed text and admission control of the scheduler (no torch)."""

from __future__ import annotations

import pytest
from sloserve.errors import InvalidRequestError, RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams

from tests.engine.fakes import EOS, FakeRunner, reference_tokens
from tests.engine.helpers import assert_all_free, drain, make_scheduler, step, tokens_of

PROMPT = [ord(c) for c in "hello there"]


def _run(params: SamplingParams, runner: FakeRunner | None = None, **sched):
    s, r, _ = make_scheduler(runner, **sched)
    s.add_request(NewRequest("x", PROMPT, params))
    outputs = drain(s, r)["x"]
    assert_all_free(s)
    return outputs, r


def test_max_tokens_gives_length():
    outputs, r = _run(SamplingParams(max_tokens=7))
    assert tokens_of(outputs) == reference_tokens(r, PROMPT, 7)
    assert [o.finished for o in outputs] == [False] * 6 + [True]
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 7
    assert "".join(o.new_text for o in outputs) == "".join(map(chr, tokens_of(outputs)))


def test_eos_stops_unless_ignored():
    runner = FakeRunner()
    runner.eos_every = 5
    expected = reference_tokens(runner, PROMPT, 200)
    assert expected[-1] == EOS and len(expected) < 200
    outputs, _ = _run(SamplingParams(max_tokens=200), runner)
    assert tokens_of(outputs) == expected and outputs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outputs) == "".join(map(chr, expected[:-1]))
    runner = FakeRunner()
    runner.eos_every = 5
    outputs, _ = _run(SamplingParams(max_tokens=len(expected) + 3, ignore_eos=True), runner)
    assert len(tokens_of(outputs)) == len(expected) + 3 and outputs[-1].finish_reason == "length"


def test_stop_token_ids_stop():
    runner = FakeRunner()
    expected = reference_tokens(runner, PROMPT, 20)
    outputs, _ = _run(SamplingParams(max_tokens=20, stop_token_ids=[expected[4]]), runner)
    assert tokens_of(outputs) == expected[: expected.index(expected[4]) + 1]
    assert outputs[-1].finish_reason == "stop"


def test_stop_string_cuts_the_text_and_is_never_streamed():
    runner = FakeRunner()
    text = "".join(map(chr, reference_tokens(runner, PROMPT, 30)))
    stop = text[10:13]
    outputs, _ = _run(SamplingParams(max_tokens=30, stop=[stop, "never-seen"]), runner)
    streamed = "".join(o.new_text for o in outputs)
    assert streamed == text[: text.index(stop)]
    assert outputs[-1].finish_reason == "stop"
    assert all(stop not in o.new_text for o in outputs)


def test_max_model_len_gives_length():
    runner = FakeRunner(max_model_len=16)
    outputs, _ = _run(SamplingParams(max_tokens=100), runner)
    assert len(tokens_of(outputs)) == 16 - len(PROMPT) and outputs[-1].finish_reason == "length"


def test_multibyte_characters_are_never_split_in_the_stream():
    runner = FakeRunner(vocab=(0xC3, 0xC4))  # always 0xC3: the 2-byte lead of 'é'..'ÿ'
    s, r, _ = make_scheduler(runner)
    s.add_request(NewRequest("x", [0xC3], SamplingParams(max_tokens=4)))
    deltas = [o.new_text for o in drain(s, r)["x"]]
    assert "\ufffd" not in "".join(deltas[:-1])


def test_bad_requests_are_rejected_with_a_message():
    s, _, _ = make_scheduler(FakeRunner(max_model_len=16))
    with pytest.raises(InvalidRequestError, match="empty"):
        s.add_request(NewRequest("a", [], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="at most 15"):
        s.add_request(NewRequest("a", [1] * 16, SamplingParams()))
    s.add_request(NewRequest("a", [1], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add_request(NewRequest("a", [1], SamplingParams()))


def test_queue_cap_refuses_and_counts():
    s, _, _ = make_scheduler(max_waiting=2)
    s.add_request(NewRequest("a", [1, 2], SamplingParams()))
    s.add_request(NewRequest("b", [1, 2], SamplingParams()))
    with pytest.raises(RequestRefusedError) as info:
        s.add_request(NewRequest("c", [1, 2], SamplingParams()))
    assert info.value.reason == "queue_full"
    assert s.stats()["refusals"] == {"queue_full": 1}
    s.abort("a")
    s.abort("b")
    assert_all_free(s)


def test_deadline_already_passed_is_refused():
    s, _, clock = make_scheduler()
    with pytest.raises(RequestRefusedError) as info:
        s.add_request(
            NewRequest(
                "late", [1, 2], SamplingParams(), SLO(ttft_s=0.5), arrival_time=clock.t - 1.0
            )
        )
    assert info.value.reason == "deadline_passed"
    s2, _, clock2 = make_scheduler(admission_control=False)
    s2.add_request(
        NewRequest("late", [1, 2], SamplingParams(), SLO(ttft_s=0.5), arrival_time=clock2.t - 1.0)
    )


def test_unattainable_slo_is_refused_once_prefill_speed_is_known():
    s, r, _ = make_scheduler(max_batch=1, adaptive_batch=False)
    # no estimate yet
    s.add_request(NewRequest("early", [1] * 100, SamplingParams(max_tokens=1), SLO(ttft_s=0.05)))
    for _ in range(5):
        s.admission.speed.observe(1000, 1.0)  # 1000 tokens/s
    # 'loose' waits behind 'early' only: (100 + 30) tokens at 1000 tokens/s = 0.13 s < 0.75 * 0.5 s
    s.add_request(NewRequest("loose", [2] * 30, SamplingParams(max_tokens=1), SLO(ttft_s=0.5)))
    # a 0.15 s request is queued ahead of 'loose': 100 + 100 tokens = 0.2 s > 0.75 * 0.15 s
    with pytest.raises(RequestRefusedError) as info:
        s.add_request(NewRequest("nope", [3] * 100, SamplingParams(max_tokens=1), SLO(ttft_s=0.15)))
    s.add_request(NewRequest("fits", [3] * 100, SamplingParams(max_tokens=1), SLO(ttft_s=0.35)))
    assert info.value.reason == "slo_unattainable" and "relax the SLO" in str(info.value)
    # no explicit SLO: queued
    s.add_request(NewRequest("no-slo", [3] * 100, SamplingParams(max_tokens=1)))
    drain(s, r)
    assert_all_free(s)


def test_queue_timeout_refuses_waiting_requests_and_frees_everything():
    s, r, clock = make_scheduler(max_batch=1, adaptive_batch=False, queue_timeout_s=1.0)
    s.add_request(NewRequest("busy", [1] * 5, SamplingParams(max_tokens=30)))
    s.add_request(NewRequest("waits", [2] * 5, SamplingParams(max_tokens=1)))
    step(s, r)
    clock.t += 2.0
    _, outputs = step(s, r)
    refused = [o for o in outputs if o.request_id == "waits"]
    assert refused[0].finished and refused[0].refusal_reason == "queue_timeout"
    assert "queue timeout" in refused[0].error
    assert s.stats()["refusals"] == {"queue_timeout": 1}
    drain(s, r)
    assert_all_free(s)


def test_step_cost_model_separates_overhead_from_per_token_cost():
    from sloserve.sched.slo.step_model import StepCostModel

    model = StepCostModel()
    for tokens in (1, 2, 500, 3, 1000, 1):
        model.observe(tokens, 0.015 + 0.001 * tokens)
    overhead, per_token = model.fit()
    assert overhead == pytest.approx(0.015) and per_token == pytest.approx(0.001)
    assert model.seconds_for(4096, 2048) == pytest.approx(4.096 + 2 * 0.015)
    decode_only = StepCostModel()
    for _ in range(10):
        decode_only.observe(2, 0.015)  # small steps say nothing about prefill speed
    assert decode_only.fit() is None and decode_only.seconds_for(1000, 2048) is None


def test_a_request_waiting_for_a_claimed_prefix_outlives_the_queue_timeout():
    """Its wait is by design (the prefix is being computed for it), and it costs a tail then."""
    s, r, clock = make_scheduler(
        max_batch=8,
        adaptive_batch=False,
        queue_timeout_s=1.0,
        prefill_chunk=8,
        max_batched_tokens=8,
    )
    shared = [3] * 40
    s.add_request(NewRequest("first", shared, SamplingParams(max_tokens=1)))
    s.add_request(NewRequest("twin", list(shared), SamplingParams(max_tokens=1)))
    step(s, r)  # 'first' computes 8 tokens and claims its other blocks: 'twin' waits for them
    clock.t += 2.0
    outputs = drain(s, r)
    assert not any(o.refusal_reason for o in outputs["twin"])
    assert tokens_of(outputs["twin"]) == tokens_of(outputs["first"])
    assert s.stats()["refusals"] == {}
