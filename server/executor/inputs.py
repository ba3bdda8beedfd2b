"""SchedulerOutput sequences -> one flat batch of device tensors, written into preallocated buffers.

The buffers are carved from the device pool once; a step writes its values into their leading
slices (through a pinned host staging copy on CUDA), so building inputs allocates no device
memory. Metadata is computed with a handful of numpy operations, never a Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from sloserve.batch import ScheduledSequence
from sloserve.layers.attention import AttentionMetadata, build_arrays
from sloserve.memory.pool import DevicePool

_BUFFERS = {  # name -> (dtype, length kind)
    "token_ids": (torch.int64, "tokens"),
    "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"),
    "cu_seqlens": (torch.int32, "seqs+1"),
    "seq_lens": (torch.int32, "seqs"),
    "start_pos": (torch.int32, "seqs"),
    "sample_idx": (torch.int64, "seqs"),
    "block_tables": (torch.int32, "seqs*blocks"),
}


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_idx: torch.Tensor  # [S'] int64, flat row of each sampled sequence's last token
    sampled: list[int]  # index into the step's sequences of each sampled row


def workspace_bytes(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """Bytes the input buffers take in the pool (for sizing it)."""
    total = 0
    for dtype, kind in _BUFFERS.values():
        size = torch.empty((), dtype=dtype).element_size()
        total += _length(kind, max_tokens, max_seqs, max_blocks) * size + 256
    return total


def _length(kind: str, max_tokens: int, max_seqs: int, max_blocks: int) -> int:
    return {"tokens": max_tokens, "seqs": max_seqs, "seqs+1": max_seqs + 1,
            "seqs*blocks": max_seqs * max_blocks}[kind]


class InputBuilder:
    """Fills the pool-carved input buffers for one step."""

    def __init__(self, pool: DevicePool, staging: DevicePool | None, max_tokens: int, max_seqs: int,
                 max_blocks: int, block_size: int, vocab_size: int, max_model_len: int, num_pages: int) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.num_pages = num_pages
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len
        self.device = pool.device
        self._dev: dict[str, torch.Tensor] = {}
        self._staging: dict[str, torch.Tensor] = {}  # only when the device is not the host
        self._host: dict[str, np.ndarray] = {}  # numpy views the step writes into
        for name, (dtype, kind) in _BUFFERS.items():
            shape = (_length(kind, max_tokens, max_seqs, max_blocks),)
            self._dev[name] = pool.carve(f"inputs.{name}", shape, dtype)
            if staging is not None:  # CUDA: pinned host staging, copied asynchronously
                self._staging[name] = staging.carve(f"staging.{name}", shape, dtype)
                self._host[name] = self._staging[name].numpy()
            else:  # CPU: write straight into the pool buffer
                self._host[name] = self._dev[name].numpy()

    def _bad_token_message(self, seqs: list[ScheduledSequence], tokens: np.ndarray) -> str:
        """Which id is out of range, in which request, and the vocabulary size."""
        at = int(np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))[0])
        for seq in seqs:
            if at < len(seq.token_ids):
                break
            at -= len(seq.token_ids)
        return (f"token id {int(seq.token_ids[at])} of request {seq.req_id!r} is outside the model's vocabulary "
                f"of {self.vocab_size} tokens: token ids must be in [0, {self.vocab_size})")

    def build(self, seqs: list[ScheduledSequence]) -> StepInputs:
        """Flat inputs and attention metadata for `seqs` (prefill chunks and decode tokens mixed)."""
        num_seqs = len(seqs)
        query_lens = [len(s.token_ids) for s in seqs]
        num_tokens = sum(query_lens)
        start_pos = [s.start_pos for s in seqs]
        tables = [s.block_table for s in seqs]
        width = max(len(t) for t in tables)
        if num_seqs > self.max_seqs or num_tokens > self.max_tokens or width > self.max_blocks:
            raise ValueError(
                f"step of {num_seqs} sequences / {num_tokens} tokens / {width} blocks exceeds the executor's "
                f"buffers ({self.max_seqs} / {self.max_tokens} / {self.max_blocks}): the scheduler must respect "
                "max_batch, max_batched_tokens and max_model_len"
            )
        if min(query_lens) < 1:
            raise ValueError("every scheduled sequence needs at least one token to compute")
        arrays = build_arrays(query_lens, start_pos, tables, self.block_size, max_blocks=width)
        tokens = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=num_tokens)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError(self._bad_token_message(seqs, tokens))
        max_len = int(arrays.seq_lens.max())
        if max_len > self.max_model_len:
            raise ValueError(f"a sequence reaches {max_len} tokens, beyond max_model_len {self.max_model_len}")
        if int(arrays.block_tables.max()) >= self.num_pages or int(arrays.block_tables.min()) < 0:
            raise ValueError(f"block ids must be in [0, {self.num_pages}), got "
                             f"{int(arrays.block_tables.min())}..{int(arrays.block_tables.max())}")
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        sample_idx = arrays.cu_seqlens_q[1:][sampled].astype(np.int64) - 1
        values = {
            "token_ids": tokens, "positions": arrays.positions, "slot_mapping": arrays.slot_mapping,
            "cu_seqlens": arrays.cu_seqlens_q, "seq_lens": arrays.seq_lens, "start_pos": arrays.start_pos,
            "sample_idx": sample_idx, "block_tables": arrays.block_tables.reshape(-1),
        }
        views = {}
        for name, value in values.items():
            n = value.shape[0]
            self._host[name][:n] = value
            dev = self._dev[name][:n]
            if self._staging:
                dev.copy_(self._staging[name][:n], non_blocking=True)
            views[name] = dev
        meta = AttentionMetadata(
            cu_seqlens_q=views["cu_seqlens"],
            seq_lens=views["seq_lens"],
            start_pos=views["start_pos"],
            block_tables=views["block_tables"].view(num_seqs, width),
            slot_mapping=views["slot_mapping"],
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max_len,
            cu_seqlens_q_list=arrays.cu_seqlens_q.tolist(),
            seq_lens_list=arrays.seq_lens.tolist(),
            start_pos_list=start_pos,
            block_tables_list=tables,
            block_size=self.block_size,
        )
        return StepInputs(views["token_ids"], views["positions"], meta, views["sample_idx"], sampled)
