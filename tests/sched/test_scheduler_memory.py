"""Blocks without torch: preemption victim, no thrashing, prefix reuse, swap/recompute, accounting."""

from __future__ import annotations

import pytest
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.sched.request import RequestStatus

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


def _three_requests(mode: str):
    # 7 usable blocks of 4 tokens; three 8-token prompts take 6; the first decode needs 3 more.
    runner = FakeRunner(num_blocks=8, block_size=4, num_host_blocks=16)
    s, r, _ = make_scheduler(runner, preemption_mode=mode, max_batch=8, adaptive_batch=False)
    prompts = {"tight": [ord("a")] * 8, "mid": [ord("b")] * 8, "loose": [ord("c")] * 8}
    for (name, prompt), ttft in zip(prompts.items(), (0.5, 1.0, 5.0), strict=True):
        s.add_request(NewRequest(name, prompt, SamplingParams(max_tokens=6), SLO(ttft_s=ttft)))
    return s, r, prompts


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_least_urgent_running_request_is_preempted(mode):
    s, r, prompts = _three_requests(mode)
    collected = {}
    _, outs = step(s, r)
    loose_blocks = list(s.requests["loose"].block_table)
    out, outs2 = step(s, r)
    loose = s.requests["loose"]
    assert loose.status == RequestStatus.PREEMPTED and loose.num_preemptions == 1
    assert [q.req_id for q in out.sequences] == ["tight", "mid"]
    assert s.waiting.peek() is loose
    if mode == "swap":
        assert [dev for dev, _ in out.swap_out] == loose_blocks
        assert loose.num_computed_tokens == 8 and loose.is_swapped
    else:
        assert not out.swap_out and loose.num_computed_tokens == 0 and not loose.block_table
    for o in outs + outs2:
        collected.setdefault(o.request_id, []).append(o)
    drain(s, r, collected=collected)
    for name, prompt in prompts.items():
        assert tokens_of(collected[name]) == reference_tokens(r, prompt, 6), name
    assert s.counters.preemptions_total >= 1
    assert_all_free(s)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    runner = FakeRunner(num_blocks=8, block_size=4, num_host_blocks=1)
    s, r, _ = make_scheduler(runner, preemption_mode="swap", max_batch=8, adaptive_batch=False)
    for name, c, ttft in (("tight", "a", 0.5), ("mid", "b", 1.0), ("loose", "c", 5.0)):
        s.add_request(
            NewRequest(name, [ord(c)] * 8, SamplingParams(max_tokens=6), SLO(ttft_s=ttft))
        )
    _, first = step(s, r)
    out, _ = step(s, r)
    loose = s.requests["loose"]
    assert not out.swap_out and not loose.is_swapped and loose.num_computed_tokens == 0
    got = [o for o in first if o.request_id == "loose"] + drain(s, r)["loose"]
    assert tokens_of(got) == reference_tokens(r, [ord("c")] * 8, 6)
    assert_all_free(s)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_just_resumed_request_is_not_the_next_victim(mode, monkeypatch):
    runner = FakeRunner(num_blocks=12, block_size=2, num_host_blocks=64)
    s, r, _ = make_scheduler(
        runner, preemption_mode=mode, max_batch=8, adaptive_batch=False, prefix_cache=False
    )
    prompts = random_prompts(6, 3, 6, seed=3)
    for i, prompt in enumerate(prompts):
        s.add_request(
            NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=14), SLO(ttft_s=1.0 + i))
        )
    spared = 0
    original = s.preemption.preempt

    def preempt(req, out):
        nonlocal spared
        resumed_now = [x for x in s.running if x.resumed_step is not None and x is not req]
        just_resumed = req.resumed_step is not None
        scheduled = {q.req_id for q in out.sequences}  # already placed in this step: not candidates
        others = [
            x
            for x in s.running
            if x is not req
            and x.request_id not in scheduled
            and x.resumed_step is None
            and x.block_table
        ]
        assert not just_resumed or not others, f"{req.request_id} preempted right after resuming"
        spared += any(s._urgency(x) > s._urgency(req) for x in resumed_now)
        original(req, out)

    monkeypatch.setattr(s.preemption, "preempt", preempt)
    collected = drain(s, r)
    assert spared > 0, "the workload never put a just-resumed request at the end of the line"
    for i, prompt in enumerate(prompts):
        assert tokens_of(collected[f"r{i}"]) == reference_tokens(r, prompt, 14)
    assert_all_free(s)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("policy", ["slo", "fifo"])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_tight_memory_gives_the_same_tokens_as_running_alone(mode, policy, prefix_cache, chunked):
    runner = FakeRunner(num_blocks=12, block_size=4, num_host_blocks=12)
    s, r, _ = make_scheduler(
        runner,
        preemption_mode=mode,
        policy=policy,
        prefix_cache=prefix_cache,
        chunked_prefill=chunked,
        max_batched_tokens=24,
        prefill_chunk=8,
        max_batch=8,
        adaptive_batch=False,
    )
    shared = [ord(c) for c in "shared-prefix-xyz"]
    prompts = [
        shared[:k] + p
        for k, p in zip(
            [0, 17, 17, 9, 17, 0, 12, 17, 17, 4], random_prompts(10, 1, 12, seed=1), strict=True
        )
    ]
    for i, prompt in enumerate(prompts):
        s.add_request(
            NewRequest(
                f"r{i}", prompt, SamplingParams(max_tokens=10), SLO(ttft_s=1.0 + (i * 7) % 5)
            )
        )
    collected = drain(s, r)
    for i, prompt in enumerate(prompts):
        assert tokens_of(collected[f"r{i}"]) == reference_tokens(r, prompt, 10), f"r{i}"
        assert collected[f"r{i}"][-1].finish_reason == "length"
    assert s.counters.preemptions_total > 0
    assert_all_free(s)


def test_prefix_hit_serves_full_blocks_and_computes_at_least_the_last_token():
    s, r, _ = make_scheduler(max_batch=8, adaptive_batch=False)
    prompt = [ord(c) for c in "abcdefghijk"]  # 2 full blocks of 4 and 3 tokens
    s.add_request(NewRequest("cold", prompt, SamplingParams(max_tokens=4)))
    cold = tokens_of(drain(s, r)["cold"])
    s.add_request(NewRequest("warm", prompt, SamplingParams(max_tokens=4)))
    out = s.schedule()
    seq = out.sequences[0]
    assert (seq.start_pos, seq.token_ids, seq.kv_present) == (
        8,
        prompt[8:],
        0,
    )  # the partial block computed
    outputs = update(s, out, r.execute(out)) + drain(s, r)["warm"]
    assert tokens_of(outputs) == cold == reference_tokens(r, prompt, 4)
    assert outputs[-1].num_cached_tokens == 8
    assert_all_free(s)


def test_a_block_aligned_prompt_seen_before_computes_only_its_last_token_and_writes_no_shared_block():
    """Repeated attempts at one prompt: the hit covers every token, so only the last one is
    computed again (for its logits), marked kv_present: the fake runner checks that its shared
    slot already holds what computing it gives, and writes nothing there."""
    s, r, _ = make_scheduler(max_batch=8, adaptive_batch=False)
    prompt = [ord(c) for c in "abcdefghijkl"]  # exactly 3 blocks of 4
    s.add_request(NewRequest("cold", prompt, SamplingParams(max_tokens=4)))
    cold = tokens_of(drain(s, r)["cold"])
    shared = list(s.block_manager.find_prefix(prompt)[0])
    assert len(shared) == 3
    before = r.kv[:]
    s.add_request(NewRequest("warm", prompt, SamplingParams(max_tokens=4)))
    out = s.schedule()
    seq = out.sequences[0]
    assert (seq.start_pos, seq.token_ids, seq.kv_present) == (11, prompt[11:], 1)
    assert seq.block_table == shared
    outputs = update(s, out, r.execute(out))
    assert r.kv == before  # the shared blocks are untouched
    outputs += drain(s, r)["warm"]
    assert tokens_of(outputs) == cold == reference_tokens(r, prompt, 4)
    assert outputs[-1].num_cached_tokens == 11
    assert s.counters.prefix_hit_tokens_total == 11 and s.counters.prompt_tokens_total == 24
    assert s.counters.computed_prompt_tokens_total == 13
    assert_all_free(s)
    assert s.block_manager.num_cached > 0


def test_a_colliding_hash_with_different_tokens_is_a_miss():
    s, r, _ = make_scheduler()
    bm = s.block_manager
    prompt = [ord(c) for c in "abcdefghij"]
    s.add_request(NewRequest("a", prompt, SamplingParams(max_tokens=1)))
    drain(s, r)
    blocks, _, _ = bm.find_prefix(prompt)
    assert len(blocks) == 2
    bm._tokens[blocks[0]] = tuple(ord(c) for c in "zzzz")  # as if another prefix hashed the same
    assert bm.find_prefix(prompt)[0] == []


def test_a_request_waits_for_a_prefix_block_being_computed_instead_of_recomputing_it():
    s, r, _ = make_scheduler(
        max_batched_tokens=64, prefill_chunk=64, max_batch=8, adaptive_batch=False
    )
    prompt = [ord(c) for c in "the same long prompt, twice"]
    s.add_request(NewRequest("first", prompt, SamplingParams(max_tokens=3)))
    s.add_request(NewRequest("second", prompt, SamplingParams(max_tokens=3)))
    out, _ = step(s, r)
    assert [q.req_id for q in out.sequences] == ["first"]
    out, outputs = step(s, r)
    second = next(q for q in out.sequences if q.req_id == "second")
    assert second.start_pos == 24
    collected = drain(s, r, collected={"second": [o for o in outputs if o.request_id == "second"]})
    assert tokens_of(collected["second"]) == reference_tokens(r, prompt, 3)
    assert_all_free(s)


def _follower_after_one_chunk(**sched):
    """A 24-token prompt prefilled 8 tokens a step (a bystander keeps it from running alone, which
    would take it whole); the same prompt arrives after its first chunk."""
    s, r, clock = make_scheduler(
        prefill_chunk=8, max_batched_tokens=64, max_batch=8, adaptive_batch=False, **sched
    )
    prompt = [ord(c) for c in "one ARC task, attempt 1!"]
    s.add_request(
        NewRequest("leader", prompt, SamplingParams(max_tokens=3, ignore_eos=True), SLO(e2e_s=30.0))
    )
    s.add_request(
        NewRequest(
            "bystander",
            [ord("z")] * 40,
            SamplingParams(max_tokens=3, ignore_eos=True),
            SLO(e2e_s=30.0),
        )
    )
    step(s, r)
    return s, r, clock, prompt


def test_an_urgent_newcomer_does_not_wait_for_a_claimed_prefix():
    """A follower whose TTFT cannot wait for the leader's prefill computes the prefix itself."""
    from tests.sched.test_deadline_scheduling import price

    s, r, _, prompt = _follower_after_one_chunk(policy="slo", admission_control=False)
    for tokens in (1, 4, 64, 256, 512, 16):  # priced steps: the deadline plan is on
        s.admission.on_compute(tokens, price(tokens))
    s.add_request(
        NewRequest(
            "follower", prompt, SamplingParams(max_tokens=3, ignore_eos=True), SLO(ttft_s=0.02)
        )
    )
    out, _ = step(s, r)
    follower = [q for q in out.sequences if q.req_id == "follower"]
    # the leader's first chunk hit, the rest computed
    assert follower and follower[0].start_pos == 8
    drain(s, r)
    assert_all_free(s)


def test_abort_frees_blocks_at_once_and_mid_step_results_are_dropped():
    s, r, _ = make_scheduler()
    for i, prompt in enumerate(random_prompts(4, 5, 30, seed=2)):
        s.add_request(NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=50)))
    step(s, r)
    step(s, r)
    out = s.schedule()
    final = abort(s, "r1")  # while the step is 'on the device'
    assert final.finished and final.finish_reason == "cancelled"
    s.update(out, r.execute(out))
    assert "r1" not in s.requests
    assert s.abort("r1") is None
    s.abort("r0")
    s.abort("r2")
    s.abort("r3")
    assert_all_free(s)
    assert s.schedule().finished_req_ids == ["r1", "r0", "r2", "r3"]


@pytest.mark.parametrize("policy", ["slo", "fifo"])
def test_a_preempted_request_keeps_its_place_in_the_queue(policy):
    runner = FakeRunner(num_blocks=8, block_size=4, num_host_blocks=16)
    s, r, clock = make_scheduler(
        runner, policy=policy, max_batch=3, adaptive_batch=False, max_wait_s=0.2
    )
    for name, c, ttft in (("tight", "a", 0.5), ("mid", "b", 1.0), ("loose", "c", 5.0)):
        s.add_request(
            NewRequest(name, [ord(c)] * 8, SamplingParams(max_tokens=6), SLO(ttft_s=ttft))
        )
    step(s, r)
    clock.t += 0.3  # 'loose' has now been in the system longer than max_wait (0.2 s)
    s.add_request(
        NewRequest("newcomer", [ord("d")] * 8, SamplingParams(max_tokens=6), SLO(ttft_s=0.4))
    )
    step(s, r)  # 'loose' is preempted and queued again
    assert s.requests["loose"].status == RequestStatus.PREEMPTED
    s.waiting.rekey(clock.t)  # as the next schedule() does
    # slo: its wait counts from arrival, so the starvation guard puts it ahead of the tighter
    # newcomer; fifo: it goes back to the front
    assert [q.request_id for q in s.waiting.in_order()] == ["loose", "newcomer"]


def _orphans(s) -> set[int]:
    """Device blocks in use that no live request holds."""
    bm, held = s.block_manager, set()
    for q in s.requests.values():
        held.update(q.block_table)
    return {b for b in range(1, bm.num_usable + 1) if bm.allocator.ref_count(b) > 0} - held


@pytest.mark.parametrize("seed", [21, 30, 38])  # each leaked blocks before the fix
def test_an_overload_with_preemptions_aborts_and_urgent_newcomers_holds_no_block_for_nobody(seed):
    """Arrivals faster than a small pool serves, tight and loose objectives, aborts: after every
    step each block in use belongs to a live request, and all are free at the end. (Regression: a
    request preempted to free a slot for an urgent newcomer was also scheduled in the same step,
    and got device blocks while swapped out; swap-in then dropped them.)"""
    import random

    from sloserve.errors import RequestRefusedError

    rng = random.Random(seed)
    s, r, _ = make_scheduler(
        FakeRunner(num_blocks=64, num_host_blocks=64, block_size=16),
        num_scheduler_steps=8,
        max_batch=16,
    )
    for tokens in (1, 2, 500, 3, 1000, 1):  # priced steps: the deadline plan and slot preemption
        s.admission.speed.observe(tokens, 0.001 + 0.0001 * tokens)
    n = 0
    for _ in range(400):
        for _ in range(rng.randint(0, 6)):
            n += 1
            slo = SLO(ttft_s=rng.choice([0.05, 0.5, 1.0])) if rng.random() < 0.8 else None
            params = SamplingParams(max_tokens=rng.choice([8, 32, 64]), ignore_eos=True)
            try:
                s.add_request(
                    NewRequest(
                        f"o{n}",
                        list(f"o{n} overload prompt of a few dozen bytes.".encode()),
                        params,
                        slo,
                    )
                )
            except RequestRefusedError:
                pass
        if rng.random() < 0.1 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        step(s, r)
        assert not _orphans(s)
    assert s.counters.preemptions_total > 0
    drain(s, r)
    assert_all_free(s)
