"""The split between the scheduler and the engine's output stage: the scheduler stops requests on
stop tokens and length, the output stage turns tokens into text and ends a request at a stop
string, dropping the later tokens of its run (Scheduler.stop_early) -- the same tokens, text and
finish reasons as when the scheduler matched stop strings while applying each token."""

from __future__ import annotations

import pytest
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

from tests.engine.fakes import FakeRunner, reference_tokens
from tests.engine.helpers import OUTPUT_STAGES, abort, drain, make_scheduler, step


def _prompt(i: int) -> list[int]:
    return [97 + (i * 7 + k) % 26 for k in range(3 + i % 9)]


def _expected(runner: FakeRunner, i: int, max_tokens: int) -> tuple[list[int], str, str]:
    """Tokens, text and finish reason of request i, whose stop string is two characters of its own text."""
    tokens = reference_tokens(runner, _prompt(i), max_tokens)
    text = "".join(map(chr, tokens))
    stop = text[8 + i : 10 + i]
    end = text.find(stop)
    return tokens[: end + len(stop)], text[:end], stop


@pytest.mark.parametrize("steps", [1, 8])
def test_a_stop_string_ends_its_request_where_it_completes_even_inside_a_run(steps):
    runner = FakeRunner(num_blocks=256)
    s, r, _ = make_scheduler(runner, num_scheduler_steps=steps)
    expected = {}
    for i in range(8):
        tokens, text, stop = _expected(r, i, 40)
        expected[f"r{i}"] = tokens, text
        s.add_request(NewRequest(f"r{i}", _prompt(i), SamplingParams(max_tokens=40, stop=[stop])))
    outputs = drain(s, r)
    for rid, (tokens, text) in expected.items():
        got = outputs[rid]
        assert [t for o in got for t in o.new_token_ids] == tokens, rid
        assert "".join(o.new_text for o in got) == text, rid
        assert got[-1].finish_reason == "stop" and got[-1].num_output_tokens == len(tokens)
    assert s.stats()["generated_tokens_total"] == sum(len(t) for t, _ in expected.values())
    assert s.block_manager.num_free == s.block_manager.num_usable
    assert OUTPUT_STAGES[s].live == 0  # every finished request's text is let go
    if steps > 1:
        # runs happened, and stops fell inside them
        assert max(out.num_steps for out in r.steps) > 1


def test_a_stop_string_on_the_last_token_turns_length_into_stop():
    s, r, _ = make_scheduler(FakeRunner(num_blocks=64))
    tokens = reference_tokens(r, _prompt(0), 6)
    stop = "".join(map(chr, tokens[4:6]))
    if stop in "".join(map(chr, tokens[:5])):
        pytest.skip("the fake's text repeats the pair earlier")
    s.add_request(NewRequest("a", _prompt(0), SamplingParams(max_tokens=6, stop=[stop])))
    out = drain(s, r)["a"]
    assert [t for o in out for t in o.new_token_ids] == tokens
    assert out[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in out) == "".join(map(chr, tokens[:4]))


def test_an_aborted_request_lets_go_of_its_text():
    s, r, _ = make_scheduler(FakeRunner(num_blocks=64))
    s.add_request(NewRequest("a", _prompt(0), SamplingParams(max_tokens=30, stop=["~~"])))
    for _ in range(4):
        step(s, r)
    assert OUTPUT_STAGES[s].live == 1
    out = abort(s, "a")
    assert out.finish_reason == "cancelled" and OUTPUT_STAGES[s].live == 0
