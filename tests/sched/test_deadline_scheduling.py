"""Deadline step composition (slo policy), slack preemption and the starvation bound: torch-free.

The fake runner computes the tokens; a simulated clock advances each step by the priced step
time (overhead + per token), and the same times feed the scheduler's cost model, as the engine
loop does. Each property is also shown to fail with the mechanism switched off, so the tests
measure the mechanism rather than a lucky workload.
"""

from __future__ import annotations

from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.sched.request import RequestStatus
from sloserve.sched.slo.deadlines import ARRIVAL_WINDOW_S, DeadlinePlan, TightestRecent

from tests.engine.fakes import FakeRunner
from tests.engine.helpers import make_scheduler, update

OVERHEAD_S, PER_TOKEN_S = 0.005, 0.0001  # a 512-token chunk: 56 ms; a decode of 4: 5.4 ms


def price(tokens: int) -> float:
    return OVERHEAD_S + PER_TOKEN_S * tokens


def _scheduler(runner: FakeRunner | None = None, **sched):
    s, r, clock = make_scheduler(runner or FakeRunner(num_blocks=2048, max_model_len=4096), **sched)
    for tokens in (1, 4, 64, 256, 512, 16):  # priming: what the engine does before ready
        s.admission.on_compute(tokens, price(tokens))
    return s, r, clock


def _run(s, r, clock, steps: int, arrivals: dict | None = None) -> dict[str, list[float]]:
    """Step `steps` times; returns each request's token times (simulated clock)."""
    times: dict[str, list[float]] = {}
    for i in range(steps):
        if arrivals and i in arrivals:
            arrivals[i]()
        out = s.schedule()
        sampled = r.execute(out)
        dt = price(out.num_tokens) if out.sequences else 0.001
        clock.t += dt
        s.admission.on_compute(out.num_tokens, dt)
        for o in update(s, out, sampled):
            times.setdefault(o.request_id, []).extend([clock.t] * len(o.new_token_ids))
    return times


def _mean_tpot(token_times: list[float]) -> float:
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def _tight_tpot_with_long_prefill(**sched) -> float:
    s, r, clock = _scheduler(**sched)
    s.add_request(
        NewRequest(
            "tight", [97] * 8, SamplingParams(max_tokens=20, ignore_eos=True), SLO(tpot_s=0.012)
        )
    )
    long_prompt = [98 + i % 20 for i in range(3000)]
    arrivals = {
        3: lambda: s.add_request(
            NewRequest(
                "long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True), SLO(e2e_s=30.0)
            )
        )
    }
    times = _run(s, r, clock, 80, arrivals)
    assert len(times["tight"]) == 20
    assert len(times.get("long", [])) >= 1, "the long prompt must still be prefilled"
    return _mean_tpot(times["tight"])


def test_a_tight_tpot_request_keeps_its_tpot_while_a_long_prefill_arrives():
    # Its chunks are cut to what fits before the tight request's next token is due.
    assert _tight_tpot_with_long_prefill() <= 0.012


def test_without_deadline_steps_the_long_prefill_breaks_the_tpot():
    # Fixed 512-token chunks make 56 ms steps: the same workload misses the 12 ms TPOT.
    assert _tight_tpot_with_long_prefill(deadline_steps=False) > 0.012


def _victim(**sched) -> str:
    # 4-token blocks; three requests grow until the pool runs out and one must give way.
    s, r, clock = _scheduler(
        FakeRunner(num_blocks=14, num_host_blocks=0, max_model_len=256),
        preemption_mode="recompute",
        **sched,
    )
    s.add_request(
        NewRequest(
            "tight", [97] * 6, SamplingParams(max_tokens=40, ignore_eos=True), SLO(tpot_s=0.05)
        )
    )
    # roomy: an early deadline but a short answer; crowded: a later deadline but many tokens.
    s.add_request(
        NewRequest(
            "roomy", [98] * 6, SamplingParams(max_tokens=12, ignore_eos=True), SLO(e2e_s=5.0)
        )
    )
    s.add_request(
        NewRequest(
            "crowded", [99] * 6, SamplingParams(max_tokens=400, ignore_eos=True), SLO(e2e_s=6.0)
        )
    )
    for _ in range(40):
        _run(s, r, clock, 1)
        preempted = [q.request_id for q in s.requests.values() if q.num_preemptions]
        if preempted:
            return preempted[0]
    raise AssertionError("the pool never ran out")


def test_the_request_with_the_most_slack_is_preempted():
    # roomy: 5 s - 12 steps of ~5 ms = 4.9 s; crowded: 6 s - 400 steps = 3.9 s of slack.
    assert _victim() == "roomy"


def test_without_slack_preemption_the_latest_deadline_is_preempted():
    assert _victim(slack_preemption=False) == "crowded"


def test_no_admitted_request_goes_longer_than_max_wait_without_a_step():
    """The starvation bound: a request is computed at least once every max_wait_s plus one step.

    Eight 5.85 ms-TPOT requests leave no room under the cap (8 decodes take 5.8 ms, 9 take 5.9),
    so a request without objectives is
    optional in each step -- and still runs once it has waited max_wait_s.
    """
    max_wait_s = 0.2
    s, r, clock = _scheduler(max_wait_s=max_wait_s, adaptive_batch=False)
    for i in range(8):
        s.add_request(
            NewRequest(
                f"tight{i}",
                [97 + i] * 6,
                SamplingParams(max_tokens=400, ignore_eos=True),
                SLO(tpot_s=0.00585),
            )
        )
    s.add_request(
        NewRequest("background", [120] * 6, SamplingParams(max_tokens=400, ignore_eos=True))
    )
    times = _run(s, r, clock, 400)
    background = times["background"]
    gaps = [b - a for a, b in zip(background, background[1:], strict=False)]
    longest_step = price(9)
    assert len(background) >= 5
    assert max(gaps) > 3 * longest_step, (
        "the background request was never skipped: the test proves nothing"
    )
    assert max(gaps) <= max_wait_s + 2 * longest_step
    first_wait = background[0] - 1000.0
    assert first_wait <= max_wait_s + 2 * longest_step


def test_a_starving_newcomer_waits_for_the_prefix_a_skipped_request_is_still_prefilling():
    """Claims: with no room under the cap, two attempts at one prompt each get a chunk only when
    they starve; the second waits for the blocks the first is computing and hits them, instead of
    computing the same prompt alongside it in the steps the first is skipped."""
    s, r, clock = _scheduler(max_wait_s=0.2, adaptive_batch=False)
    for i in range(8):
        s.add_request(
            NewRequest(
                f"tight{i}",
                [97 + i] * 6,
                SamplingParams(max_tokens=2000, ignore_eos=True),
                SLO(tpot_s=0.00585),
            )
        )
    prompt = [100 + i % 7 for i in range(64)]
    times = _run(
        s,
        r,
        clock,
        200,
        {
            5: lambda: s.add_request(
                NewRequest("first", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            ),
            40: lambda: s.add_request(
                NewRequest("second", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            ),
        },
    )
    assert len(times["first"]) == len(times["second"]) == 2
    assert times["first"][0] > 1000.4, (
        "the first prompt ran in one go: nothing could be shared mid-prefill"
    )
    assert s.counters.prefix_hit_tokens_total == 63
    assert s.counters.computed_prompt_tokens_total == 8 * 6 + 64 + 1


def test_a_skipped_request_stays_running_and_keeps_its_blocks():
    s, r, clock = _scheduler(max_wait_s=0.2, adaptive_batch=False)
    for i in range(8):
        s.add_request(
            NewRequest(
                f"tight{i}",
                [97 + i] * 6,
                SamplingParams(max_tokens=50, ignore_eos=True),
                SLO(tpot_s=0.00585),
            )
        )
    s.add_request(
        NewRequest("background", [120] * 6, SamplingParams(max_tokens=50, ignore_eos=True))
    )
    _run(s, r, clock, 20)
    bg = s.requests["background"]
    assert bg.status == RequestStatus.RUNNING and bg.block_table


def _paced_finish(finish_margin: float) -> float:
    """Seconds from arrival to the last token of a 1 s end-to-end request whose steps are filled
    with a bulk prefill up to its pace (the bulk has no objective: optional work)."""
    s, r, clock = _scheduler(finish_margin=finish_margin, adaptive_batch=False)
    s.add_request(
        NewRequest(
            "paced", [97] * 8, SamplingParams(max_tokens=30, ignore_eos=True), SLO(e2e_s=1.0)
        )
    )
    for i in range(8):
        s.add_request(
            NewRequest(
                f"bulk{i}",
                [98 + (i + j) % 20 for j in range(3000)],
                SamplingParams(max_tokens=1, ignore_eos=True),
            )
        )
    times = _run(s, r, clock, 400)
    assert len(times["paced"]) == 30
    assert any(len(times.get(f"bulk{i}", [])) for i in range(8)), "the bulk must fill the steps"
    return times["paced"][-1] - 1000.0


def test_an_end_to_end_deadline_is_aimed_at_the_finish_margin_early():
    """The plan paces a request to finish `finish_margin` of its objective early (the client also
    counts the trip in and the last token's way out); without the margin it rides the deadline."""
    without, with_margin = _paced_finish(0.0), _paced_finish(0.1)
    assert 0.97 < without <= 1.0 + 1e-9, without
    assert 0.85 < with_margin <= 0.9 + 1e-9, with_margin


def _tight_tpot_among_lost_requests() -> float:
    """Eight requests that missed their 10 ms end-to-end objective at once, beside one whose 5.85 ms
    TPOT leaves no room for them (a step of all nine decodes takes 5.9 ms). Admission is off: it
    would refuse the 10 ms requests outright."""
    s, r, clock = _scheduler(max_wait_s=0.2, adaptive_batch=False, admission_control=False)
    for i in range(8):
        s.add_request(
            NewRequest(
                f"lost{i}",
                [97 + i] * 6,
                SamplingParams(max_tokens=200, ignore_eos=True),
                SLO(e2e_s=0.01),
            )
        )
    s.add_request(
        NewRequest(
            "tight", [120] * 6, SamplingParams(max_tokens=200, ignore_eos=True), SLO(tpot_s=0.00585)
        )
    )
    times = _run(s, r, clock, 400)
    assert all(len(times[f"lost{i}"]) > 10 for i in range(8)), "the lost requests are still served"
    return _mean_tpot(times["tight"])


def test_requests_that_missed_their_objectives_stop_running_ahead_of_live_ones():
    assert _tight_tpot_among_lost_requests() <= 0.00585


def test_without_the_demotion_lost_requests_break_a_live_tpot(monkeypatch):
    monkeypatch.setattr(DeadlinePlan, "missed", lambda self, r: False)
    assert _tight_tpot_among_lost_requests() > 0.00585


def _urgent_prompt_beside_a_paced_decode(tpot_s: float) -> tuple[int, float, float]:
    """A request decoding under a TPOT and a 2 s end-to-end objective; then a 400-token prompt with
    a 0.3 s TTFT arrives. Returns (steps from its arrival to its first token, the paced request's
    mean TPOT, the prompt's TTFT)."""
    s, r, clock = _scheduler()
    s.add_request(
        NewRequest(
            "paced",
            [97] * 8,
            SamplingParams(max_tokens=40, ignore_eos=True),
            SLO(tpot_s=tpot_s, e2e_s=2.0),
        )
    )
    steps: list[int] = []
    times = _run(s, r, clock, 5)
    arrival = clock.t
    s.add_request(
        NewRequest(
            "urgent",
            [98 + i % 20 for i in range(400)],
            SamplingParams(max_tokens=4, ignore_eos=True),
            SLO(ttft_s=0.3, tpot_s=0.03, e2e_s=2.0),
        )
    )
    for step in range(1, 60):
        for rid, t in _run(s, r, clock, 1).items():
            times.setdefault(rid, []).extend(t)
        if "urgent" in times and not steps:
            steps.append(step)
    assert len(times["paced"]) == 40 and len(times["urgent"]) == 4
    return steps[0], _mean_tpot(times["paced"]), times["urgent"][0] - arrival


def test_an_urgent_prompt_runs_whole_when_the_paced_decodes_can_absorb_the_step():
    """A 30 ms TPOT over decode steps of ~5 ms banks ~25 ms an output: one 45 ms step of the whole
    prompt costs the paced request a small part of that, and the prompt pays one step's overhead
    at the full-chunk price instead of many small steps'."""
    steps, tpot, _ = _urgent_prompt_beside_a_paced_decode(0.03)
    assert steps == 1 and tpot <= 0.03


def test_without_spare_time_the_urgent_prompt_is_chunked_under_the_cap(monkeypatch):
    monkeypatch.setattr("sloserve.sched.slo.deadlines.STALL_SHARE", 0.0)
    chunked, chunked_tpot, _ = _urgent_prompt_beside_a_paced_decode(0.03)
    assert chunked > 1 and chunked_tpot <= 0.03
    # a 7 ms TPOT leaves ~1.9 ms an output over a decode step: a 45 ms step would break it
    tight, tight_tpot, _ = _urgent_prompt_beside_a_paced_decode(0.007)
    assert tight > 1 and tight_tpot <= 0.007


def test_a_chunked_urgent_prompt_is_done_a_quarter_of_its_objective_after_arrival(monkeypatch):
    """Cut under the cap, an urgent prompt's chunks are sized to finish it TTFT_SAFETY of its
    objective after it arrived (75 ms of 0.3 s here, plus at most the step that returns its
    token), and the paced request still keeps its 7 ms TPOT. Aimed at half the objective, the
    same prompt's first token comes after that."""
    monkeypatch.setattr("sloserve.sched.slo.deadlines.STALL_SHARE", 0.0)
    steps, tpot, ttft = _urgent_prompt_beside_a_paced_decode(0.007)
    assert steps > 1 and tpot <= 0.007
    assert ttft <= 0.25 * 0.3 + price(64)
    monkeypatch.setattr("sloserve.sched.slo.deadlines.TTFT_SAFETY", 0.5)
    _, half_tpot, half_ttft = _urgent_prompt_beside_a_paced_decode(0.007)
    assert half_tpot <= 0.007 and half_ttft > 0.25 * 0.3 + price(64)


def test_tightest_recent_keeps_the_smallest_objective_of_the_window():
    seen = TightestRecent(window_s=10.0)
    assert seen.tightest(0.0) is None
    seen.add(0.0, 2.0)
    seen.add(1.0, 0.3)
    seen.add(2.0, 1.0)
    assert seen.tightest(5.0) == 0.3
    assert seen.tightest(10.5) == 0.3  # the 0.3 s one arrived at 1.0: still in the window
    assert seen.tightest(11.5) == 1.0  # it left; the looser one that came after it remains
    assert seen.tightest(12.5) is None


def _batch_step_tokens(
    interactive_seen: bool, later_s: float = 0.0, prefill_order: str = "arrival"
) -> int:
    """Tokens of the first step of two 1,500-token batch prompts (30 s end-to-end), when a short
    request with a 0.3 s TTFT objective arrived (and finished) just before, `later_s` earlier, or
    not at all."""
    s, r, clock = _scheduler(prefill_order=prefill_order)
    if interactive_seen:
        s.add_request(
            NewRequest(
                "interactive",
                [99] * 8,
                SamplingParams(max_tokens=2, ignore_eos=True),
                SLO(ttft_s=0.3),
            )
        )
        _run(s, r, clock, 3)
    clock.t += later_s
    for name in ("a", "b"):
        s.add_request(
            NewRequest(
                name,
                [97 + (name == "b")] * 1500,
                SamplingParams(max_tokens=2, ignore_eos=True),
                SLO(e2e_s=30.0),
            )
        )
    out = s.schedule()
    s.update(out, r.execute(out))
    return out.num_tokens


def test_steps_leave_room_for_the_first_token_of_the_next_interactive_arrival():
    """With requests under a 0.3 s TTFT arriving, a step is cut to ARRIVAL_SHARE of it (75 ms:
    700 tokens at 0.1 ms plus 5 ms), so a newcomer does not wait out a 2,048-token step first;
    without them, or once ARRIVAL_WINDOW_S has passed since the last, two full chunks run (in
    arrival order; in shortest order one prompt's chunk at a time)."""
    assert _batch_step_tokens(False) == 1024
    assert _batch_step_tokens(True) <= 700
    assert _batch_step_tokens(True, later_s=ARRIVAL_WINDOW_S + 1) == 1024
    assert _batch_step_tokens(False, prefill_order="shortest") == 512


def test_the_arrival_room_cuts_optional_prompt_chunks_not_decodes():
    from sloserve.sched.slo.step_model import StepPrice

    plan = DeadlinePlan(
        StepPrice(OVERHEAD_S, PER_TOKEN_S),
        [],
        now=0.0,
        chunk=512,
        max_wait_s=2.0,
        step_tokens=2048,
        arrival_ttft_s=0.3,
    )
    assert plan.room(0, 0) == 700 and plan.room(700, 0) == 0  # 75 ms: 5 ms + 700 tokens
    assert plan.decode_fits(700, 200)  # a decode rides along past it
    # an objective no useful step fits a quarter of (5 ms < 5 ms + 16 tokens) leaves no room rule
    tight = DeadlinePlan(
        StepPrice(OVERHEAD_S, PER_TOKEN_S),
        [],
        now=0.0,
        chunk=512,
        max_wait_s=2.0,
        step_tokens=2048,
        arrival_ttft_s=0.02,
    )
    assert tight.room(0, 0) == 1 << 30


def _steps_of_two_urgent_prompts(
    ttft_s: float, **sched
) -> tuple[list[set[str]], dict[str, list[float]]]:
    """A 12 ms-TPOT request decodes; two 400-token prompts with a TTFT objective arrive together.
    Returns which of them computed prompt tokens in each step, and every request's token times."""
    s, r, clock = _scheduler(**sched)
    s.add_request(
        NewRequest(
            "tight", [97] * 8, SamplingParams(max_tokens=200, ignore_eos=True), SLO(tpot_s=0.012)
        )
    )
    times = _run(s, r, clock, 3)
    for name, first in (("a", 100), ("b", 300)):
        s.add_request(
            NewRequest(
                name,
                [first + i % 90 for i in range(400)],
                SamplingParams(max_tokens=4, ignore_eos=True),
                SLO(ttft_s=ttft_s),
            )
        )
    steps = []
    for _ in range(12):
        out = s.schedule()
        steps.append({q.req_id for q in out.sequences if len(q.token_ids) > 1})
        sampled = r.execute(out)
        dt = price(out.num_tokens)
        clock.t += dt
        s.admission.on_compute(out.num_tokens, dt)
        for o in update(s, out, sampled):
            times.setdefault(o.request_id, []).extend([clock.t] * len(o.new_token_ids))
    return steps, times


def test_one_urgent_prompt_a_step_goes_past_the_cap_when_the_next_can_wait():
    # Together the two prompts would make a ~90 ms step that the decode waits through; one a step,
    # each ~45 ms, it gets a token between them, and both first tokens still come well inside 0.3 s.
    steps, times = _steps_of_two_urgent_prompts(ttft_s=0.3)
    assert not any({"a", "b"} <= step for step in steps)
    assert times["a"][0] - 1000.0 < 0.3 and times["b"][0] - 1000.0 < 0.3
    assert {times["a"][0], times["b"][0]} <= set(times["tight"]), (
        "the decode got a token with each prompt's step"
    )


def test_an_urgent_prompt_that_cannot_wait_a_step_joins_the_one_past_the_cap():
    # 60 ms of TTFT for a 45 ms prompt: waiting behind the other's step would miss it (admission
    # off: it keeps a margin and would refuse so tight an objective).
    steps, _ = _steps_of_two_urgent_prompts(ttft_s=0.06, admission_control=False)
    assert any({"a", "b"} <= step for step in steps)


def _burst(prefill_order: str, prompts: dict[str, list[int]], slo: SLO | None = None):
    """A burst of `prompts` on a primed scheduler (prefill_chunk 64): the first step's chunks, each
    request's first-token time, and the scheduler."""
    s, r, clock = _scheduler(prefill_order=prefill_order, prefill_chunk=64)
    for name, tokens in prompts.items():
        s.add_request(NewRequest(name, tokens, SamplingParams(max_tokens=2, ignore_eos=True), slo))
    first = s.schedule()
    chunks = [(q.req_id, len(q.token_ids)) for q in first.sequences]
    s.update(first, r.execute(first))
    clock.t += price(first.num_tokens)
    times = _run(s, r, clock, 40)
    return chunks, {name: t[0] for name, t in times.items()}, s


def test_a_burst_finishes_its_prompts_one_after_another_least_remaining_first():
    """Without objectives, shortest order gives one prompt's chunk a step, the least remaining
    prefill first: first tokens in prompt-length order and sooner on average than arrival order's
    (which advances every prompt together), for the same prompt tokens computed."""
    prompts = {"long": [97] * 300, "short": [98] * 100, "mid": [99] * 200}
    chunks, times, s = _burst("shortest", prompts)
    assert chunks == [("short", 64)]
    assert times["short"] < times["mid"] < times["long"]
    chunks_a, times_a, s_a = _burst("arrival", prompts)
    assert chunks_a == [("long", 64), ("short", 64), ("mid", 64)]
    assert sum(times.values()) < sum(times_a.values())
    assert sorted(times.values())[1] < sorted(times_a.values())[1]
    computed = "computed_prompt_tokens_total"
    assert s.counters.counters()[computed] == s_a.counters.counters()[computed] == 600


def test_a_sibling_waits_for_the_shared_prompt_then_its_tail_rides_with_the_next_prompt():
    """Two requests of one prompt compute it once: the first queued starts (neither has a block
    cached or being computed: equal work, so arrival decides), the second waits for its claimed
    blocks, then computes its last token in the step of the next prompt's chunk."""
    shared = [97] * 100
    chunks, times, s = _burst("shortest", {"a1": shared, "a2": list(shared), "b": [98] * 120})
    assert chunks == [("a1", 64)]
    assert max(times[x] for x in ("a1", "a2")) < times["b"]
    counters = s.counters.counters()
    assert counters["computed_prompt_tokens_total"] == 100 + 1 + 120
    assert counters["prefix_hit_tokens_total"] == 99


def test_urgent_prompts_are_not_held_back_by_the_one_prompt_a_step_rule():
    """Prompts whose TTFT objective is at risk keep the deadline plan's chunks, however many."""
    chunks, times, _ = _burst("shortest", {"x": [97] * 200, "y": [98] * 200}, SLO(ttft_s=0.15))
    assert [name for name, n in chunks if n > 16] == ["x", "y"]
