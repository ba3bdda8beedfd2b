"""AsyncEngine: the step loop in one background thread, streams to asyncio callers.

The loop thread owns all stepping; callers on the event loop add and abort requests under a
lock that is never held during the forward pass. Outputs reach each request's asyncio queue via
`loop.call_soon_threadsafe`. Failure isolation: an exception in one request's post-processing,
or a forward that fails again when that request runs alone, finishes only that request with
'error'; an exception of the loop itself marks the engine dead (`alive` False, `dead_reason`)
and fails every pending stream with EngineDeadError. A step running longer than
`stuck_after_s` also turns `alive` False so health checks see a hung device.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from sloserve.batch import SchedulerOutput
from sloserve.config import SloserveConfig
from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.engine.scheduler import Scheduler
from sloserve.engine.stream import RequestStream
from sloserve.errors import EngineDeadError, InvalidRequestError
from sloserve.faults import FaultPlan, FaultyRunner
from sloserve.sampling_params import SLO, SamplingParams

log = logging.getLogger(__name__)
_MAX_CHARS_PER_TOKEN = 16


class AsyncEngine:
    """Continuous batching over a ModelRunner (or anything with its API)."""

    def __init__(self, config: SloserveConfig, runner: Any = None, *, stuck_after_s: float = 120.0) -> None:
        self.config = config
        self.stuck_after_s = stuck_after_s
        self._runner = runner
        self._scheduler: Scheduler | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._dead_reason: str | None = None
        self._busy_since: float | None = None
        self._steps: deque[tuple[float, int]] = deque(maxlen=64)  # (seconds, tokens) of recent steps
        self.ready = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm up the model in a worker thread, then start the loop thread."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="sloserve-engine", daemon=True)
        self._thread.start()
        self.ready = True

    def _load(self) -> None:
        if self._runner is None:
            from sloserve.executor import ModelRunner  # NOTE: lazy, so the engine imports no torch

            self._runner = ModelRunner(self.config)
        runner = self._runner
        plan = FaultPlan.parse(self.config.faults)
        if plan:
            log.warning("fault injection is ON (%s): for tests only", self.config.faults)
            self._runner = runner = FaultyRunner(runner, plan)
        runner.warmup()
        self._scheduler = Scheduler(
            self.config, num_blocks=runner.num_kv_blocks, block_size=runner.block_size,
            max_model_len=runner.max_model_len, num_host_blocks=runner.num_host_blocks,
            eos_token_ids=runner.eos_token_ids, decode=runner.tokenizer.decode)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (waiting up to timeout_s for a running step); pending requests end 'cancelled'."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        if self._scheduler is not None:
            with self._lock:
                for request_id in list(self._scheduler.requests):
                    out = self._scheduler.abort(request_id)
                    if out is not None:
                        self._deliver([out])
        self.ready = False

    @property
    def alive(self) -> bool:
        """The loop thread runs, has not died, and no step has been stuck past stuck_after_s."""
        thread = self._thread
        if self._dead_reason is not None or thread is None or not thread.is_alive():
            return False
        busy = self._busy_since
        return busy is None or time.monotonic() - busy < self.stuck_after_s

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler (for inspection and benchmarks; mutate it only through the engine)."""
        return self._scheduler

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def tokenizer(self) -> Any:
        return self._runner.tokenizer if self._runner is not None else None

    @property
    def model_info(self) -> dict:
        if self._runner is None or self._scheduler is None:
            return {}
        info = dict(self._runner.info())
        info.setdefault("model", self.config.model.path)
        info["max_model_len"] = self._scheduler.max_model_len
        info["block_size"] = self._runner.block_size
        return info

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    slo: SLO | None = None, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; raises InvalidRequestError / RequestRefusedError / EngineDeadError now."""
        self._check_running()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_ids(prompt)
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._check_running()
            self._scheduler.add_request(request_id, token_ids, params, slo, arrival_time)
            self._streams[request_id] = stream
        self._wake.set()
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       slo: SLO | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; leaving early (break, cancellation) aborts the request."""
        stream = self.add_request(request_id, prompt, params, slo)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a live request and free its blocks now; its stream ends with 'cancelled'."""
        if self._scheduler is None:
            return False
        with self._lock:
            out = self._scheduler.abort(request_id)
            if out is None:
                return False
            self._deliver([out])
        return True

    def stats(self) -> EngineStats:
        if self._scheduler is None:
            return EngineStats()
        with self._lock:
            stats = self._scheduler.stats()
            steps = list(self._steps)
        if steps:
            stats.step_time_s = sum(s for s, _ in steps) / len(steps)
            stats.tokens_per_step = sum(n for _, n in steps) / len(steps)
        return stats

    def _check_running(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead_reason}")
        if not self.ready or self._stopping or self._scheduler is None:
            raise EngineDeadError("the engine is not running (await engine.start() first)")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: send some text or token ids")
            # NOTE: tokenizing runs on the caller's event loop; a text far longer than any prompt
            # that could fit is refused before paying for it (no tokenizer averages 16 chars/token).
            limit = self._scheduler.max_model_len * _MAX_CHARS_PER_TOKEN
            if len(prompt) > limit:
                raise InvalidRequestError(
                    f"the prompt has {len(prompt)} characters, far more than the model's "
                    f"{self._scheduler.max_model_len}-token context can hold; shorten it")
            return self._runner.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of integer token ids")
        vocab = getattr(self._runner, "vocab_size", None)
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(prompt)

    # ---- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    work = self._scheduler.has_work()
                    if not work:
                        self._wake.clear()
                if work:
                    self._step()
                else:
                    self._wake.wait(0.5)
        except BaseException as exc:  # noqa: BLE001 - the loop's own death must be reported
            self._die(f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        scheduler, runner = self._scheduler, self._runner
        self._busy_since = start = time.monotonic()
        with self._lock:
            out = scheduler.schedule()
        errors: dict[str, str] | None = None
        if out.is_empty and not out.finished_req_ids:
            sampled: list[int | None] = []
        else:
            try:
                sampled = list(runner.execute(out))
            except Exception as exc:  # noqa: BLE001 - find whose request it was
                sampled, errors = self._isolate(out, exc)
        seconds = time.monotonic() - start
        with self._lock:
            outputs = scheduler.update(out, sampled, errors)
            if out.sequences:
                scheduler.admission.speed.observe(out.num_tokens, seconds)
                self._steps.append((seconds, out.num_tokens))
            self._deliver(outputs)
        self._busy_since = None
        if out.is_empty and not outputs:
            time.sleep(0.001)  # nothing could run (e.g. blocks held by a just-finished step)

    def _isolate(self, out: SchedulerOutput, exc: Exception) -> tuple[list[int | None], dict[str, str]]:
        """Re-run each sequence alone so a failure fails only its own request.

        When every sequence fails alone too, the runner is probed with a known-good request
        (one token on the null block): only if that fails as well is the runner itself broken
        and the step's exception re-raised (the loop dies); otherwise the requests were bad.
        """
        log.warning("engine step failed (%s); retrying its %d sequences one by one", exc, len(out.sequences))
        with self._lock:
            moved = self._scheduler.recover_swaps()
        sampled: list[int | None] = []
        errors: dict[str, str] = {}
        tried = 0
        for seq in out.sequences:
            token: int | None = None
            if seq.req_id not in moved:
                tried += 1
                try:
                    result = self._runner.execute(SchedulerOutput(sequences=[seq]))
                    token = result[0] if seq.sample else None
                except Exception as one:  # noqa: BLE001
                    errors[seq.req_id] = f"{type(one).__name__}: {one}"
            if seq.sample:
                sampled.append(token)
        if tried and len(errors) == tried:
            try:
                self._runner.probe()
            except Exception as probe_exc:  # noqa: BLE001 - the runner itself is broken
                log.error("the runner fails a known-good probe too (%s): it is broken", probe_exc)
                raise exc from probe_exc
        return sampled, errors

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams (call with the lock held)."""
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _die(self, reason: str) -> None:
        self._dead_reason = reason
        log.error("engine loop died: %s", reason)
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(EngineDeadError(f"the engine loop died: {reason}"))
