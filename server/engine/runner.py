"""What the engine core and its priming need of a model runner (a typing.Protocol).

The optional capabilities are declared here, not probed: `RunnerDefaults` gives each one's
"not supported" value, so a runner that lacks one inherits it instead of being asked by getattr.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sloserve.sched.output import SchedulerOutput, StepResult

if TYPE_CHECKING:
    from sloserve.tokenizer import Tokenizer

# (sequences, tokens per sequence) of a step to time, and the timing: (sequences, tokens each, seconds)
StepShape = tuple[int, int]
StepTiming = tuple[int, int, float]


@runtime_checkable
class Runner(Protocol):
    """Runs the scheduler's steps on a model; the core calls nothing else."""

    block_size: int
    num_kv_blocks: int
    num_host_blocks: int
    max_model_len: int
    eos_token_ids: Sequence[int]
    tokenizer: Tokenizer
    # ---- optional capabilities (RunnerDefaults: none of them) ----
    runs_steps: bool  # execute() takes runs of decode steps (out.num_steps > 1)
    vocab_size: int | None  # None: token ids are not checked against the vocabulary

    def warmup(self) -> None:
        """Compile / allocate whatever the first step would; called once before serving."""

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step (or a run of out.num_steps): each sequence's tokens and logprobs; raises
        when the step fails (the engine then runs its sequences alone to find whose it was)."""

    def probe(self) -> None:
        """Run a known-good one-token step; raises when the runner itself is broken."""

    def info(self) -> dict:
        """The model's description for Info / /v1/models."""

    def time_steps(self, shapes: list[StepShape]) -> list[StepTiming]:
        """Time steps of these shapes on the empty pool (priming); [] when the runner cannot."""

    def expert_stats(self) -> dict:
        """Mixture-of-experts counters, named as EngineStats' fields ({} for a dense model)."""

    def check_health(self) -> None:
        """Raise when the runner can no longer run steps (a tensor-parallel rank died)."""

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers)."""


class RunnerDefaults:
    """The optional capabilities of `Runner`, none supported: a runner inherits what it lacks."""

    runs_steps = False
    vocab_size: int | None = None

    def time_steps(self, shapes: list[StepShape]) -> list[StepTiming]:
        return []

    def expert_stats(self) -> dict:
        return {}

    def check_health(self) -> None:
        return None

    def close(self) -> None:
        return None
