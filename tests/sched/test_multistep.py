"""Runs of decode steps (--num-scheduler-steps): the same tokens as single steps, and only when
nobody waits.

A run computes each sequence's sampled token as the next step's input, back to back, without the
scheduler in between (sched/scheduler.py `_run_length`); its tokens are applied one by one, so
stop conditions, max_tokens and the prefix cache see exactly what single steps would.
"""

from __future__ import annotations

import pytest
from sloserve import LLM
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.sched import multistep
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from tests.engine.fakes import FakeRunner, reference_tokens
from tests.engine.helpers import drain, make_scheduler, step


def _prompt(i: int) -> list[int]:
    return [97 + (i * 7 + k) % 26 for k in range(3 + i % 9)]


def test_runs_give_every_request_the_tokens_it_gets_alone():
    runner = FakeRunner(num_blocks=256)
    runner.eos_every = 11  # some requests stop on EOS inside a run
    s, r, _ = make_scheduler(runner, num_scheduler_steps=4)
    max_tokens = {f"r{i}": 1 + (i * 5) % 17 + (i % 3) * 20 for i in range(10)}
    for i, rid in enumerate(max_tokens):
        s.add_request(NewRequest(rid, _prompt(i), SamplingParams(max_tokens=max_tokens[rid])))
    outputs = drain(s, r)
    for i, rid in enumerate(max_tokens):
        got = [t for out in outputs[rid] for t in out.new_token_ids]
        assert got == reference_tokens(r, _prompt(i), max_tokens[rid]), rid
    assert max(out.num_steps for out in r.steps) == 4
    assert s.block_manager.num_free == s.block_manager.num_usable  # every block came back


def test_a_run_starts_only_when_nobody_waits_and_is_cut_to_the_fewest_outputs_left():
    s, r, _ = make_scheduler(FakeRunner(num_blocks=256), num_scheduler_steps=8, max_batch=1)
    s.add_request(NewRequest("a", _prompt(1), SamplingParams(max_tokens=6, ignore_eos=True)))
    s.add_request(NewRequest("b", _prompt(2), SamplingParams(max_tokens=3, ignore_eos=True)))
    out, _ = step(s, r)  # a's prompt; b waits for the one slot
    assert out.num_steps == 1
    out, _ = step(s, r)
    assert out.num_steps == 1, "b waits: a must not run ahead"
    while "a" in s.requests:
        step(s, r)
    out, _ = step(s, r)  # b's prompt: its first token
    out, _ = step(s, r)
    assert out.num_steps == 2  # b may still produce 2 tokens
    assert len(out.sequences[0].block_table) * r.block_size >= out.sequences[0].start_pos + 2


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def checkpoint(request, make_checkpoint):
    return str(make_checkpoint(request.param))


def test_runs_of_steps_match_single_steps_on_a_real_model(checkpoint, monkeypatch):
    """Greedy, seeded sampling, stop strings and stop ids give the same tokens and text.

    Runs are not cut by time here (MAX_RUN_S): at 10 ms, a machine whose MoE decode step took
    over 2 ms ran no run of 5 and the check that runs reach their length failed.
    """
    monkeypatch.setattr(multistep, "MAX_RUN_S", 1.0)
    prompts = [_prompt(i) for i in range(8)]
    params = [SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True) for i in range(4)]
    params += [
        SamplingParams(max_tokens=20, temperature=0.8, seed=7 + i, ignore_eos=True)
        for i in range(2)
    ]
    params += [
        SamplingParams(max_tokens=24, stop=["e"], ignore_eos=True),
        SamplingParams(max_tokens=24, stop_token_ids=[101, 102], ignore_eos=True),
    ]

    def generate(steps: int):
        with LLM(
            checkpoint, device="cpu", max_model_len=128, block_size=4, num_scheduler_steps=steps
        ) as llm:
            runs = []
            run_steps = llm.engine.runner._run_steps
            llm.engine.runner._run_steps = lambda out, step: (
                runs.append(out.num_steps) or run_steps(out, step)
            )
            results = llm.generate(prompts, params)
            again = llm.generate(prompts[:2], params[:2])  # prefix hits on blocks a run committed
            return [(o.token_ids, o.text, o.finish_reason) for o in results + again], runs

    single, none = generate(1)
    runs, taken = generate(5)
    assert runs == single
    assert not none and taken and max(taken) == 5


def test_a_run_past_its_block_tables_is_an_error_not_a_stray_write(make_checkpoint):
    with LLM(str(make_checkpoint("llama")), device="cpu", max_model_len=64, block_size=4) as llm:
        # position 3 is the last slot of its one block: the run's second step has nowhere to write
        seq = ScheduledSequence("x", [97], 3, [1], True, SamplingParams(max_tokens=8))
        with pytest.raises(ValueError, match="past its block tables"):
            llm.engine.runner.execute(SchedulerOutput(sequences=[seq], num_steps=3))
