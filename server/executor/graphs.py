"""Decode steps replayed from graphs captured once per batch bucket (CUDA graphs on a GPU).

A decode step on a GPU is ~20 kernels per layer; launched one by one from Python it costs far
more host time than the GPU spends on them, whatever the batch. Captured into a CUDA graph, the
whole step is one launch.

The contract that makes a replay correct::

    InputBuilder.build_decode(seqs, bucket)   writes token ids, positions, slots, lengths and
                                              block tables IN PLACE into the leading rows of the
                                              pool-carved input buffers (same addresses every step)
    GraphDecode(step)                         replays the bucket's graph, which reads exactly those
                                              views and writes its logits into a static [B, V] buffer

A batch is padded to the smallest bucket that holds it; padding rows compute token 0 at position 0
and write their K/V to the null page (block 0), which no request reads. The logits returned are a
view of the graph's static output: the caller samples them before the next replay.

`Capture` turns a no-argument step into a replayable one: `CudaGraphCapture` records a CUDA graph
(all buckets share one memory pool, largest first); `EagerCapture` reruns the step each time (the
--enforce-eager path, and the CPU stand-in that tests the buckets, padding and buffer reuse).
GraphDecode refuses a step whose inputs are not the buffers its bucket was captured on.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch
from sloserve.executor.inputs import DecodeInputs
from sloserve.layers import triton_fused
from sloserve.layers.attention import CapturableDecode
from sloserve.models.decoder import DecoderModel

log = logging.getLogger(__name__)

Step = Callable[[], torch.Tensor]
# (input_ids, positions, slot_mapping, block_tables, seq_lens, kv) -> logits [B, V]: DecoderModel.decode
# or decode_fused with a capture-safe attention bound
DecodeForward = Callable[..., torch.Tensor]


def graph_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, ... then max_seqs (always the last).

    Past 16 each step is half the largest power of two below the size, so padding wastes at most
    a third of a batch while the number of graphs grows with log(max_seqs).
    """
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    buckets, size = [], 1
    while size < max_seqs:
        buckets.append(size)
        size = size * 2 if size < 16 else size + (1 << (size.bit_length() - 2))
    buckets.append(max_seqs)
    return buckets


def graph_reason(model: DecoderModel, capturable_attention: bool) -> str | None:
    """Why decode steps of this model cannot be captured (None when they can)."""
    if not capturable_attention:
        return f"the {model.backend.name} attention backend has no capture-safe decode kernel (triton has)"
    if model.spec.moe_layers:
        return "MoE layers route on the host"
    if model.sharded:
        return "tensor-parallel all-reduces are not captured yet"
    return None


class Capture(Protocol):
    """Turns a step (no arguments, reads static buffers) into one that replays it."""

    name: str

    def capture(self, step: Step) -> Step: ...

    def bytes_used(self) -> int: ...


class EagerCapture:
    """Runs the step again at each replay (GraphDecode still checks its inputs stayed in place)."""

    name = "eager"

    def capture(self, step: Step) -> Step:
        return step

    def bytes_used(self) -> int:
        return 0


class CudaGraphCapture:
    """CUDA graphs sharing one memory pool; each is warmed up on a side stream, then captured."""

    name = "cuda-graph"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._base = torch.cuda.memory_reserved(device)

    def capture(self, step: Step) -> Step:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles Triton kernels, sets up cuBLAS workspaces
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def bytes_used(self) -> int:
        return torch.cuda.memory_reserved(self.device) - self._base


def _addresses(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    return tuple(x for t in tensors for x in (t.data_ptr(), *t.shape))


def _args(step: DecodeInputs) -> tuple[torch.Tensor, ...]:
    return step.input_ids, step.positions, step.slot_mapping, step.block_tables, step.seq_lens


class GraphDecode:
    """Decode steps of a dense model, padded to a bucket and replayed from its captured step."""

    compiled = False
    fused = None  # the CPU one-call kernel never runs here (see executor/fused.py)

    def __init__(
        self,
        model: DecoderModel,
        kv: torch.Tensor,
        max_seqs: int,
        forward: DecodeForward,
        capture: Capture,
    ) -> None:
        why_not = graph_reason(model, True)
        if why_not:
            raise ValueError(f"decode steps cannot be captured: {why_not}")
        self.model, self.kv, self.forward, self.capturer = model, kv, forward, capture
        self.buckets = graph_buckets(max_seqs)
        # bucket -> (replay, its inputs' addresses)
        self._replays: dict[int, tuple[Step, tuple[int, ...]]] = {}
        self.capture_time_s = 0.0
        self.capture_bytes = 0

    @property
    def mode(self) -> str:
        return self.capturer.name

    def bucket(self, num_seqs: int) -> int:
        """The smallest bucket holding num_seqs rows."""
        for size in self.buckets:
            if size >= num_seqs:
                return size
        raise ValueError(
            f"{num_seqs} sequences exceed the largest decode bucket {self.buckets[-1]}"
        )

    def warm_up(self, build: Callable[[int], DecodeInputs]) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its pool), on the null page
        (the runner's start-up hook); seconds taken."""
        started = time.monotonic()
        for size in reversed(self.buckets):
            self._capture(build(size))
        self.capture_time_s = time.monotonic() - started
        self.capture_bytes = self.capturer.bytes_used()
        log.info(
            "decode step (%s): %d batch buckets %s captured in %.2fs, %.1f MiB",
            self.mode,
            len(self.buckets),
            self.buckets,
            self.capture_time_s,
            self.capture_bytes / 2**20,
        )
        return self.capture_time_s

    def _capture(self, step: DecodeInputs) -> tuple[Step, tuple[int, ...]]:
        args = _args(step)
        forward, kv = self.forward, self.kv

        def run() -> torch.Tensor:
            with torch.inference_mode():
                return forward(*args, kv)

        entry = self._replays[step.input_ids.shape[0]] = (
            self.capturer.capture(run),
            _addresses(args),
        )
        return entry

    # [B, V] float32, a view of static memory
    def __call__(self, step: DecodeInputs) -> torch.Tensor:
        entry = self._replays.get(step.input_ids.shape[0])
        # a runner used before warm_up(): capture this bucket now (a step's inputs
        if entry is None:
            # are rewritten in place, so running it again while capturing computes the same values)
            log.info(
                "decode step (%s): capturing batch bucket %d on first use",
                self.mode,
                step.input_ids.shape[0],
            )
            entry = self._capture(step)
        replay, addresses = entry
        if _addresses(_args(step)) != addresses:
            raise RuntimeError(
                "a decode step's inputs moved since its bucket was captured: the input "
                "builder must write in place into the same buffers"
            )
        return replay()


def decode_forward(model: DecoderModel, attention: CapturableDecode) -> DecodeForward:
    """The decode forward to capture: on the fused Triton kernels where they run this model (a
    power-of-two head_dim), else `DecoderModel.decode`, with the backend's capture-safe attention."""
    if triton_fused.AVAILABLE and not model.spec.head_dim & (model.spec.head_dim - 1):
        return functools.partial(model.decode_fused, attend=attention.attend_decode)
    return functools.partial(model.decode, attend=attention.decode)
