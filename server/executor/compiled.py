"""The decode step on the in-place paged kernel, eager or under torch.compile.

A decode-only step (one token per sequence, every sequence sampled) skips the general path's
attention metadata: `InputBuilder.build_decode` fills persistent buffers padded to a batch
bucket, and `DecoderModel.decode` runs on them. Compiled, Inductor fuses the elementwise work
between the matmuls (norms, rope, SwiGLU, residuals) into generated C++ and the kernel stays one
opaque custom operator; the batch dimension is dynamic, so one graph (plus batch 1, which
torch specialises) covers every bucket, and `warm_up` compiles both at start-up.

MoE models take the same path: their MoE layers run eagerly between compiled regions (a graph
break per MoE layer; routing sets the shapes and which experts are resident), and their
batches are not padded: a padding row would be routed and count as expert traffic.

NOTE: on a CPU, compiling takes ~30 s per graph and pays only at small batches (where Python
dispatch outweighs the matmuls); eager stays the default there (ModelConfig.enforce_eager).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
from sloserve.executor.fused import FusedDecode, fused_reason
from sloserve.executor.inputs import DecodeInputs
from sloserve.layers.attention import paged
from sloserve.layers.attention.sdpa import SdpaBackend
from sloserve.models.decoder import DecoderModel

log = logging.getLogger(__name__)


def batch_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_seqs (which is always the last bucket)."""
    buckets = [1]
    while buckets[-1] * 2 < max_seqs:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] != max_seqs:
        buckets.append(max_seqs)
    return buckets


def decode_path_reason(model: DecoderModel, kv: torch.Tensor) -> str | None:
    """Why decode steps cannot take the fast path (None when they can)."""
    if not isinstance(model.backend, SdpaBackend) or model.backend.inplace is False:
        return f"the {model.backend.name} backend is named"
    if not paged.AVAILABLE:
        return "the paged kernel extension is not built"
    if kv.device.type != "cpu" or kv.dtype not in paged.CACHE_DTYPES:
        return (
            f"the in-place kernel runs float32, bfloat16 or int8 caches on a CPU, not {kv.dtype} "
            f"on {kv.device.type}"
        )
    return None


class DecodeStep:
    """Runs `DecoderModel.decode` on bucket-padded inputs, compiled or eager."""

    def __init__(
        self, model: DecoderModel, kv: torch.Tensor, max_seqs: int, compiled: bool, threads: int = 1
    ) -> None:
        self.model, self.kv = model, kv
        self.buckets = batch_buckets(max_seqs)
        self.compiled = compiled
        self.pads = compiled and not model.spec.moe_layers
        self._fn: Callable[..., torch.Tensor] = model.decode
        # Eager small batches run as one C call when the model allows (see executor/fused.py).
        why_not = None if compiled else fused_reason(model, kv)
        self.fused = FusedDecode(model, kv, threads) if not compiled and why_not is None else None
        if why_not:
            log.info("decode steps run without the fused C step: %s", why_not)
        if compiled:
            # NOTE: KV and the step inputs are views of one uint8 pool buffer. Inputs that share a
            # storage make AOTAutograd merge them into views of one base (refused when one is
            # mutated and their dtypes differ; measured here: wrong logits when none is). The graph
            # gets the same memory under storages of its own: CPU aliases through numpy, no copy
            # (the compiled path is CPU-only).
            self.kv = torch.from_numpy(kv.numpy())
            # NOTE: dynamic batch: one graph for every bucket > 1 (batch 1 is specialised by torch).
            self._fn = torch.compile(
                functools.partial(model.decode, attend=paged.paged_write_and_attend),
                dynamic=True,
                fullgraph=not model.spec.moe_layers,
            )

    def bucket(self, num_seqs: int) -> int:
        """The smallest bucket holding num_seqs rows (eager and MoE run unpadded)."""
        if not self.pads:
            return num_seqs
        for size in self.buckets:
            if size >= num_seqs:
                return size
        raise ValueError(
            f"{num_seqs} sequences exceed the largest decode bucket {self.buckets[-1]}"
        )

    def __call__(self, step: DecodeInputs) -> torch.Tensor:  # [B, V] float32
        if self.fused is not None and self.fused.takes(step):
            return self.fused(step)
        with torch.inference_mode():
            args = (
                step.input_ids,
                step.positions,
                step.slot_mapping,
                step.block_tables,
                step.seq_lens,
            )
            # the inputs share the pool's storage too: same memory, storages of their own
            if self.compiled:
                args = tuple(torch.from_numpy(a.numpy()) for a in args)
            return self._fn(*args, self.kv)

    def warm_up(self, build: Callable[[int], DecodeInputs]) -> float:
        """Run (and, compiled, compile) every shape once on the null page; seconds taken."""
        started = time.monotonic()
        for size in (1, self.buckets[-1]) if self.compiled else (1,):
            self(build(size))
        seconds = time.monotonic() - started
        if self.compiled:
            log.info(
                "compiled the decode step for batch buckets %s in %.1fs", self.buckets, seconds
            )
        return seconds
