"""Building a Scheduler over the fake runner and driving it step by step."""

from __future__ import annotations

import random
import weakref

from sloserve.config import CacheConfig, SchedulerConfig, SloserveConfig
from sloserve.engine.output_processor import OutputProcessor
from sloserve.engine.outputs import RequestOutput
from sloserve.sched.scheduler import Scheduler
from sloserve.testing.clock import Clock

from tests.engine.fakes import FakeRunner


def make_scheduler(
    runner: FakeRunner | None = None,
    clock: Clock | None = None,
    *,
    prefix_cache: bool = True,
    **sched,
) -> tuple[Scheduler, FakeRunner, Clock]:
    runner = runner or FakeRunner()
    clock = clock or Clock()
    # one token per step unless a test runs steps (test_multistep)
    sched.setdefault("num_scheduler_steps", 1)
    config = SloserveConfig(
        cache=CacheConfig(prefix_cache=prefix_cache), scheduler=SchedulerConfig(**sched)
    )
    scheduler = Scheduler(
        config,
        num_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        num_host_blocks=runner.num_host_blocks,
        eos_token_ids=runner.eos_token_ids,
        clock=clock,
    )
    OUTPUT_STAGES[scheduler] = OutputProcessor(runner.tokenizer.decode)
    return scheduler, runner, clock


# The engine's output stage of each scheduler built here (text, stop strings), as EngineCore keeps one
OUTPUT_STAGES: weakref.WeakKeyDictionary[Scheduler, OutputProcessor] = weakref.WeakKeyDictionary()


def outputs_of(scheduler: Scheduler, requests) -> list[RequestOutput]:
    """What EngineCore makes of the requests a scheduler call returned: their outputs, text included."""
    return OUTPUT_STAGES[scheduler].process(requests, scheduler)


def update(scheduler: Scheduler, out, sampled, *args) -> list[RequestOutput]:
    """scheduler.update followed by the output stage, as EngineCore.update runs them."""
    return outputs_of(scheduler, scheduler.update(out, sampled, *args))


def abort(scheduler: Scheduler, request_id: str) -> RequestOutput | None:
    """scheduler.abort with its output, as EngineCore.abort returns it."""
    req = scheduler.abort(request_id)
    return None if req is None else outputs_of(scheduler, [req])[0]


def step(scheduler: Scheduler, runner: FakeRunner):
    out = scheduler.schedule()
    return out, update(scheduler, out, runner.execute(out))


def drain(
    scheduler: Scheduler,
    runner: FakeRunner,
    max_steps: int = 20_000,
    collected: dict[str, list[RequestOutput]] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Step until no work is left; every output grouped by request id."""
    collected = {} if collected is None else collected
    for _ in range(max_steps):
        if not scheduler.has_work():
            return collected
        _, outputs = step(scheduler, runner)
        for o in outputs:
            collected.setdefault(o.request_id, []).append(o)
    raise AssertionError("the scheduler did not finish its requests")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def random_prompts(
    n: int, lo: int, hi: int, seed: int = 0, alphabet: str = "abcdefgh"
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[ord(rng.choice(alphabet)) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_all_free(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert bm.num_free == bm.num_usable, f"{bm.num_usable - bm.num_free} blocks still held"
    assert bm.num_host_free == bm.num_host_blocks
    assert not scheduler.running and not len(scheduler.waiting) and not scheduler.requests
    # no bookkeeping outlives its request (regression: an empty claim list per request leaked)
    assert not bm._claims_by_req and not bm._claims
