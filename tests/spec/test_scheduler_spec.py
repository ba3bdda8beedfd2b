"""Speculation at the scheduler, over the fake runner: drafts scheduled, accepted runs committed,
the rest rolled back, and every token as decoding one at a time gives."""

from __future__ import annotations

import random

import pytest
from sloserve.errors import InvalidRequestError, RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams

from tests.engine.fakes import FakeRunner, reference_tokens
from tests.engine.helpers import (
    abort,
    assert_all_free,
    drain,
    make_scheduler,
    random_prompts,
    step,
    tokens_of,
    update,
)


def _orphans(s) -> set[int]:
    """Device blocks in use that no live request holds."""
    bm, held = s.block_manager, set()
    for q in s.requests.values():
        held.update(q.block_table)
    return {b for b in range(1, bm.num_usable + 1) if bm.allocator.ref_count(b) > 0} - held


def _small_vocab_runner(**kw) -> FakeRunner:
    # two tokens: prompt lookup guesses right about half the time
    return FakeRunner(vocab=(97, 99), **kw)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_ngram_speculation_gives_the_tokens_of_decoding_one_at_a_time(k, prefix_cache):
    r = _small_vocab_runner()
    s, r, _ = make_scheduler(
        r,
        prefix_cache=prefix_cache,
        speculation="ngram",
        num_speculative_tokens=k,
        max_batch=8,
        adaptive_batch=False,
    )
    prompts = random_prompts(6, 3, 20, seed=k, alphabet="ab")
    for i, prompt in enumerate(prompts):
        s.add_request(NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    collected = drain(s, r)
    for i, prompt in enumerate(prompts):
        assert tokens_of(collected[f"r{i}"]) == reference_tokens(r, prompt, 30), f"r{i}"
        final = collected[f"r{i}"][-1]
        assert final.num_accepted_tokens <= final.num_drafted_tokens
    assert s.counters.spec_accepted_tokens_total > 0
    assert s.counters.spec_drafted_tokens_total > s.counters.spec_accepted_tokens_total
    # a verify step yields its accepted drafts and one more token: fewer steps than tokens
    assert len(r.steps) < 6 * 30
    assert_all_free(s)


def test_a_verify_step_schedules_drafts_after_the_last_token_and_keeps_only_the_blocks_it_needs():
    r = FakeRunner(block_size=4)
    s, r, _ = make_scheduler(r, speculation="off", num_speculative_tokens=6)
    prompt = [ord(c) for c in "abcde"]
    answer = reference_tokens(r, prompt, 12)
    wrong = answer[:4] + [ord("z")] * 8  # the model rejects the fifth draft on
    s.add_request(NewRequest("p", prompt, SamplingParams(max_tokens=12), prediction=wrong))
    step(s, r)  # the prompt, and the first token
    out, _ = step(s, r)
    seq = out.sequences[0]
    assert seq.num_drafts == 6 and seq.token_ids == [answer[0], *wrong[1:7]]
    assert seq.start_pos == len(prompt) and len(seq.block_table) == 3  # positions 0..11
    req = s.requests["p"]
    # accepted wrong[1:4] and the model's own token: 5 outputs, 10 tokens, 9 computed
    assert req.output_token_ids == answer[:5]
    assert req.num_computed_tokens == 9 and len(req.block_table) == 3
    assert (req.num_drafted, req.num_accepted) == (6, 3)
    assert (req.prediction_accepted, req.prediction_rejected) == (3, 3)
    got = drain(s, r)["p"]
    assert req.output_token_ids == answer
    assert got[-1].accepted_prediction_tokens == req.prediction_accepted
    assert_all_free(s)


def test_rolled_back_blocks_go_back_to_the_pool_and_no_rejected_token_is_hashed():
    r = FakeRunner(block_size=2)
    s, r, _ = make_scheduler(r, num_speculative_tokens=8)
    prompt = [ord(c) for c in "abcd"]
    answer = reference_tokens(r, prompt, 10)
    wrong = [answer[0]] + [ord("z")] * 9  # every draft rejected
    s.add_request(NewRequest("p", prompt, SamplingParams(max_tokens=10), prediction=wrong))
    step(s, r)
    free_before = s.block_manager.num_free
    out, _ = step(s, r)
    req = s.requests["p"]
    assert out.sequences[0].num_drafts == 8 and req.num_output_tokens == 2
    assert len(req.block_table) == s.block_manager.blocks_for(req.num_tokens)
    # the draft blocks came back: one more than before holds the next token's position
    assert s.block_manager.num_free == free_before - 1
    hashed = len(req.block_hashes) * 2
    assert hashed <= req.num_computed_tokens
    assert s.block_manager.find_prefix(prompt + wrong)[0] == req.block_table[: len(prompt) // 2]
    drain(s, r)
    assert_all_free(s)


def test_a_prediction_equal_to_the_answer_is_accepted_whole():
    r = FakeRunner()
    s, r, _ = make_scheduler(r, num_speculative_tokens=8)
    prompt = [ord(c) for c in "grid 0 1 2"]
    answer = reference_tokens(r, prompt, 25)
    s.add_request(
        NewRequest("p", prompt, SamplingParams(max_tokens=25, ignore_eos=True), prediction=answer)
    )
    got = drain(s, r)["p"]
    assert tokens_of(got) == answer
    # one prefill step (the first token), then 24 tokens at up to 9 a step
    assert sum(1 for o in r.steps if o.sequences) == 1 + 3
    final = got[-1]
    assert final.rejected_prediction_tokens == 0
    assert (
        final.accepted_prediction_tokens == 24 - 3
    )  # each verify step's last token is the model's
    assert_all_free(s)


@pytest.mark.parametrize("seed", range(4))
def test_a_wrong_prediction_still_gives_the_exact_output(seed):
    rng = random.Random(seed)
    r = FakeRunner()
    s, r, _ = make_scheduler(r, num_speculative_tokens=rng.choice([2, 5, 16]))
    prompt = [ord(c) for c in f"task {seed}"]
    answer = reference_tokens(r, prompt, 40)
    prediction = list(answer)
    for _ in range(rng.randint(1, 6)):  # a few cells edited, some dropped, some inserted
        at = rng.randrange(len(prediction))
        what = rng.choice(["edit", "drop", "insert"])
        if what == "edit":
            prediction[at] = ord(rng.choice("xyz"))
        elif what == "drop":
            del prediction[at]
        else:
            prediction.insert(at, ord("q"))
    s.add_request(
        NewRequest(
            "p", prompt, SamplingParams(max_tokens=40, ignore_eos=True), prediction=prediction
        )
    )
    got = drain(s, r)["p"]
    assert tokens_of(got) == answer
    assert got[-1].accepted_prediction_tokens > 0
    assert_all_free(s)


def test_stops_apply_to_each_accepted_token_in_order():
    r = FakeRunner()
    prompt = [ord(c) for c in "stops"]
    answer = reference_tokens(r, prompt, 30)
    stop_at = next(i for i in range(5, 30) if answer[i] not in answer[:i])
    text = bytes(answer).decode("latin-1")
    cases = [
        (SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[answer[stop_at]]), "stop"),
        (SamplingParams(max_tokens=17, ignore_eos=True), "length"),
        (
            SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[stop_at : stop_at + 2]]),
            "stop",
        ),
    ]
    for params, reason in cases:
        plain, _, _ = make_scheduler(FakeRunner(), speculation="off")
        plain.add_request(NewRequest("p", prompt, params))
        want = drain(plain, FakeRunner())["p"]
        s, r2, _ = make_scheduler(FakeRunner(), num_speculative_tokens=16)
        s.add_request(NewRequest("p", prompt, params, prediction=answer[: params.max_tokens]))
        got = drain(s, r2)["p"]
        assert tokens_of(got) == tokens_of(want)
        assert "".join(o.new_text for o in got) == "".join(o.new_text for o in want)
        assert got[-1].finish_reason == want[-1].finish_reason == reason
        assert sum(1 for o in r2.steps if o.sequences) < 6  # the stop came inside an accepted run
        assert_all_free(s)


def test_a_prediction_longer_than_max_tokens_or_the_context_is_refused_with_what_to_change():
    r = FakeRunner(max_model_len=64)
    s, r, _ = make_scheduler(r)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        NewRequest("a", [97] * 4, SamplingParams(max_tokens=3), prediction=[97] * 4)
    with pytest.raises(InvalidRequestError, match="context"):
        s.add_request(
            NewRequest("b", [97] * 40, SamplingParams(max_tokens=30), prediction=[97] * 30)
        )
    with pytest.raises(InvalidRequestError, match="token ids"):
        NewRequest("c", [97], SamplingParams(max_tokens=3), prediction=[-1])


def test_requests_whose_logits_something_steers_get_no_drafts_and_sampled_ones_do():
    s, r, _ = make_scheduler(FakeRunner(), num_speculative_tokens=4, max_batch=8)
    prompt = [ord(c) for c in "abc"]
    answer = reference_tokens(r, prompt, 8)
    for name, params in {
        "sampled": SamplingParams(max_tokens=8, temperature=1.0, seed=1),
        "logprobs": SamplingParams(max_tokens=8, logprobs=0),
        "penalty": SamplingParams(max_tokens=8, presence_penalty=0.5),
        "bias": SamplingParams(max_tokens=8, logit_bias={97: 1.0}),
        "min_tokens": SamplingParams(max_tokens=8, min_tokens=6),
    }.items():
        s.add_request(NewRequest(name, prompt, params, prediction=answer))
    drafted = set()
    for _ in range(4):
        out, _ = step(s, r)
        drafted |= {q.req_id for q in out.sequences if q.num_drafts}
    assert drafted == {"sampled"}


@pytest.mark.parametrize("seed", [21, 30, 38, 5])
def test_an_overload_with_speculation_preemptions_and_aborts_mid_verify_leaks_no_block(seed):
    """Arrivals faster than a small pool serves, prompt lookup on every request and predictions
    on some, aborts between a verify step's schedule and its results: after every step each
    block in use belongs to a live request, finished requests have the tokens of decoding alone,
    and all blocks are free at the end."""
    rng = random.Random(seed)
    r = _small_vocab_runner(num_blocks=48, num_host_blocks=64, block_size=8)
    s, r, _ = make_scheduler(
        r, speculation="ngram", num_speculative_tokens=6, max_batch=16, num_scheduler_steps=8
    )
    for tokens in (1, 2, 500, 3, 1000, 1):  # priced steps: the deadline plan and slot preemption
        s.admission.speed.observe(tokens, 0.001 + 0.0001 * tokens)
    prompts: dict[str, tuple[list[int], int]] = {}
    finished: dict[str, list] = {}
    aborted: set[str] = set()
    verified = 0
    n = 0
    for _ in range(300):
        for _ in range(rng.randint(0, 5)):
            n += 1
            prompt = list(f"o{n} overload {'ab' * rng.randint(1, 8)}".encode())
            max_tokens = rng.choice([8, 32, 64])
            slo = SLO(ttft_s=rng.choice([0.05, 0.5, 1.0])) if rng.random() < 0.8 else None
            prediction = None
            if rng.random() < 0.3:
                prediction = reference_tokens(r, prompt, max_tokens)
                if rng.random() < 0.5:
                    prediction[rng.randrange(len(prediction))] = ord("z")
            try:
                s.add_request(
                    NewRequest(
                        f"o{n}",
                        prompt,
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        slo,
                        prediction=prediction,
                    )
                )
                prompts[f"o{n}"] = (prompt, max_tokens)
            except RequestRefusedError:
                pass
        out = s.schedule()
        verified += sum(1 for q in out.sequences if q.num_drafts)
        if rng.random() < 0.15 and s.requests:  # mid-verify: after schedule, before update
            victim = rng.choice(list(s.requests))
            abort(s, victim)
            aborted.add(victim)
        for o in update(s, out, r.execute(out)):
            finished.setdefault(o.request_id, []).append(o)
        assert not _orphans(s)
    assert s.counters.preemptions_total > 0
    assert verified > 0 and s.counters.spec_accepted_tokens_total > 0
    for rid, outs in drain(s, r).items():
        finished.setdefault(rid, []).extend(outs)
    assert_all_free(s)
    for rid, outs in finished.items():
        if rid in aborted or outs[-1].finish_reason != "length":
            continue
        prompt, max_tokens = prompts[rid]
        assert tokens_of(outs) == reference_tokens(r, prompt, max_tokens), rid
