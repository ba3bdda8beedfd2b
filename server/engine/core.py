"""EngineCore: the synchronous engine -- add, abort, step() -> outputs, stats.

It owns the scheduler (with admission and the block manager) and the model runner, and knows
nothing of threads, event loops, processes or transports: the offline `LLM` calls it directly,
`AsyncEngine` drives it from a thread, and the engine process drives it from its own loop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from sloserve.config import SloserveConfig
from sloserve.engine.adapters import Adapters
from sloserve.engine.output_processor import OutputProcessor
from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.engine.priming import prime
from sloserve.engine.runner import Runner
from sloserve.errors import InvalidRequestError
from sloserve.new_request import NewRequest
from sloserve.sched.output import SchedulerOutput, StepResult
from sloserve.sched.quantiles import nearest_rank
from sloserve.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from sloserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MEAN_OVER_STEPS = 64  # stats' mean step time and tokens per step
PERCENTILE_EVERY = 64  # steps between re-sorts for the step-time percentiles


class EngineCore:
    """One scheduler and one runner; every call comes from one thread at a time (callers serialise)."""

    def __init__(
        self,
        config: SloserveConfig,
        runner: Runner | None = None,
        *,
        lock: contextlib.AbstractContextManager | None = None,
    ) -> None:
        """Load (unless `runner` is given) and warm up. `lock` guards the scheduler where execute()
        touches it, for a caller that runs add/abort concurrently with execute (AsyncEngine)."""
        self._lock = lock if lock is not None else contextlib.nullcontext()
        if runner is None:
            runner = load_runner(config)
        runner.warmup()
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(
            config,
            num_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            max_model_len=runner.max_model_len,
            num_host_blocks=runner.num_host_blocks,
            eos_token_ids=runner.eos_token_ids,
        )
        self.output = OutputProcessor(runner.tokenizer.decode)
        self.adapters = Adapters(getattr(runner, "lora", None), self.scheduler)
        if not runner.runs_steps:  # a runner that runs one step per call
            self.scheduler.max_steps = 1
        if config.scheduler.admission_control or config.scheduler.policy == "slo":
            # NOTE: before ready, so a flood right after start-up is priced, not let in blindly
            prime(runner, self.scheduler.admission, config.scheduler, self.scheduler.max_model_len)
        # (seconds, tokens) of recent steps
        self._steps: deque[tuple[float, int]] = deque(maxlen=512)
        # NOTE: stats() runs after every step in the engine process: the percentiles are re-sorted
        # only every PERCENTILE_EVERY steps (and when idle), not on each call.
        self._percentiles = (0.0, 0.0)  # step time p50, p99
        self._steps_since_percentiles = 0
        self._steps_total = 0  # model steps and the runner's seconds on them, since ready
        self._busy_seconds_total = 0.0

    # ---- requests ----------------------------------------------------------------------
    def add(self, new: NewRequest) -> None:
        """Queue a request; raises InvalidRequestError / RequestRefusedError now."""
        vocab = self.runner.vocab_size
        bad = [t for t in new.token_ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad = [t for t in new.params.logit_bias or () if vocab is not None and t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab})"
            )
        bad = [t for t in new.prediction or () if vocab is not None and t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"the prediction has token id {bad[0]}, outside the vocabulary [0, {vocab})"
            )
        self.adapters.check(new.params.adapter)
        self.scheduler.add_request(new)
        self.adapters.admitted(new.params.adapter)

    def report_delivery_lag(self, lag_s: float) -> None:
        """The front end's delay in handing a first token to its client (admission prices it)."""
        self.scheduler.admission.report_delivery_lag(lag_s, time.monotonic())

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a live request as 'cancelled' and free its blocks now; None if it is not live."""
        req = self.scheduler.abort(request_id)
        return None if req is None else self.output.process([req], self.scheduler)[0]

    def unload_adapter(self, name: str, in_flight: str = "refuse") -> list[RequestOutput]:
        """Unload LoRA adapter `name` (Adapters.unload); the final outputs of requests it ended."""
        return self.output.process(self.adapters.unload(name, in_flight), self.scheduler)

    def abort_all(self) -> list[RequestOutput]:
        """Finish every live request as 'cancelled' (shutdown, a dead engine loop): their last outputs."""
        return self.output.process(self.scheduler.abort_all(), self.scheduler)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the batch, apply the results: the outputs of every request that moved."""
        out = self.schedule()
        return self.update(out, *self.execute(out))

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, out: SchedulerOutput) -> tuple[StepResult, float]:
        """Run the step on the runner: its result (a failed request's error in it) and seconds taken."""
        start = time.monotonic()
        if out.is_empty and not out.finished_req_ids:
            return StepResult(), 0.0
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # noqa: BLE001 - find whose request it was
            result = self._isolate(out, exc)
        return result, time.monotonic() - start

    def update(
        self, out: SchedulerOutput, result: StepResult, seconds: float
    ) -> list[RequestOutput]:
        moved = self.scheduler.update(out, result)
        outputs = self.output.process(moved, self.scheduler)
        if self.adapters.registry is not None and len(self.adapters.registry):
            self.adapters.count(moved, [len(o.new_token_ids) for o in outputs])
        if self.adapters.draining:
            self.adapters.sweep()
        if out.sequences:
            tokens, each = out.num_tokens, seconds / out.num_steps  # a run: priced per step
            for _ in range(out.num_steps):
                self.scheduler.admission.on_compute(tokens, each, out.num_decodes)
                self._steps.append((each, tokens))
            self._steps_since_percentiles += out.num_steps
            self._steps_total += out.num_steps
            self._busy_seconds_total += seconds
        return outputs

    def _isolate(self, out: SchedulerOutput, exc: Exception) -> StepResult:
        """Re-run each sequence alone so a failure fails only its own request.

        When every sequence fails alone too, the runner is probed with a known-good request
        (one token on the null block): only if that fails as well is the runner itself broken
        and the step's exception re-raised (the engine dies); otherwise the requests were bad.
        """
        log.warning(
            "engine step failed (%s); retrying its %d sequences one by one", exc, len(out.sequences)
        )
        with self._lock:
            moved = self.scheduler.recover_swaps()
        result = StepResult([[] for _ in out.sequences])
        tried = 0
        for i, seq in enumerate(out.sequences):
            if seq.req_id in moved:
                continue
            tried += 1
            try:
                alone = self.runner.execute(SchedulerOutput(sequences=[seq]))
            except Exception as one:  # noqa: BLE001
                result.errors[i] = f"{type(one).__name__}: {one}"
                continue
            result.tokens[i] = alone.tokens[0]
            result.logprobs.update(alone.logprobs)
            result.prompt_logprobs.update(alone.prompt_logprobs)
        if tried and len(result.errors) == tried:
            try:
                self.runner.probe()
            except Exception as probe_exc:  # noqa: BLE001 - the runner itself is broken
                log.error("the runner fails a known-good probe too (%s): it is broken", probe_exc)
                raise exc from probe_exc
        return result

    # ---- supervision -------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise when the runner can no longer run steps (a tensor-parallel rank died); cheap, call when idle."""
        self.runner.check_health()

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers)."""
        self.runner.close()

    # ---- inspection --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Scheduler stats plus step times: mean of the last 64 steps, p50/p99 of the last 512."""
        stats = EngineStats(**self.scheduler.stats())
        recent = list(itertools.islice(reversed(self._steps), MEAN_OVER_STEPS))
        if recent:
            stats.step_time_s = sum(s for s, _ in recent) / len(recent)
            stats.tokens_per_step = sum(n for _, n in recent) / len(recent)
        pending = self._steps_since_percentiles
        if pending and (pending >= PERCENTILE_EVERY or not self.scheduler.has_work()):
            ordered = sorted(s for s, _ in self._steps)
            self._percentiles = (nearest_rank(ordered, 0.5), nearest_rank(ordered, 0.99))
            self._steps_since_percentiles = 0
        stats.step_time_p50_s, stats.step_time_p99_s = self._percentiles
        stats.steps_total, stats.busy_seconds_total = self._steps_total, self._busy_seconds_total
        for (
            name,
            value,
        ) in self.runner.expert_stats().items():  # MoE runners: host counters, no device read
            setattr(stats, name, value)
        for name, value in self.adapters.stats().items():
            setattr(stats, name, value)
        return stats

    @property
    def tokenizer(self) -> Tokenizer:
        return self.runner.tokenizer

    @property
    def model_info(self) -> dict:
        info = dict(self.runner.info())
        info.setdefault("model", self.config.model.path)
        info["max_model_len"] = self.scheduler.max_model_len
        info["block_size"] = self.runner.block_size
        info.setdefault("vocab_size", self.runner.vocab_size)
        info["lora_adapters"] = self.adapters.names()
        return info


def load_runner(config: SloserveConfig) -> Runner:
    """The runner the config asks for: one ModelRunner, or rank 0 of a tensor-parallel group."""
    # NOTE: lazy imports, so the engine imports no torch until it loads a model
    if config.parallel.tensor_parallel_size > 1:
        from sloserve.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(config)
    from sloserve.executor import ModelRunner

    return ModelRunner(config)
