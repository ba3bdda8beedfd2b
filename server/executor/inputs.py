"""SchedulerOutput sequences -> one flat batch of device tensors, written into preallocated buffers.

The buffers are carved from the device pool once; a step writes its values into their leading
slices (through a pinned host staging copy on CUDA), so building inputs allocates no device
memory. Metadata is computed with a handful of numpy operations, never a Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
from sloserve.layers.attention import AttentionMetadata, build_arrays
from sloserve.layers.attention.metadata import MetadataArrays
from sloserve.memory.pool import DevicePool
from sloserve.sched.output import ScheduledSequence

_BUFFERS = {  # name -> (dtype, length kind)
    "token_ids": (torch.int64, "tokens"),
    "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"),
    "cu_seqlens": (torch.int32, "seqs+1"),
    "seq_lens": (torch.int32, "seqs"),
    "start_pos": (torch.int32, "seqs"),
    "sample_idx": (torch.int64, "rows"),
    "block_tables": (torch.int32, "seqs*blocks"),
}


@dataclass(slots=True)
class DecodeInputs:
    """A decode-only step, padded to a batch bucket (padding rows write and read the null page 0)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    num_seqs: int  # the real rows, first; B - num_seqs rows are padding


@dataclass(slots=True)
class TokenRows:
    """A step of prefill chunks and decode tokens laid out one row per token, for the fused kernel
    (executor/fused.py): each row has its position, slot, length (position + 1) and its sequence's
    block table. Host tensors: the kernel runs on a CPU only."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [T, width] int32, row t: the table of token t's sequence
    seq_lens: torch.Tensor  # [T] int32
    # [S' + P + D] int64, row of each sampled sequence's last token, then prompt rows, then draft rows
    sample_idx: torch.Tensor
    sampled: list[int]  # index into the step's sequences of each sampled row
    # (sequence index, positions) of the prompt-logprob rows, in order
    prompt_rows: list[tuple[int, range]]
    # (sequence index, drafts) of the sequences verifying drafts, in order (see draft_rows)
    draft_rows: list[tuple[int, int]]


@dataclass(slots=True)
class _FlatStep:
    """A step's checked metadata, shared by the flat path's inputs and the kernel's rows."""

    arrays: MetadataArrays
    tokens: np.ndarray  # [T] int64
    query_lens: list[int]
    start_pos: list[int]
    tables: list[list[int]]
    max_len: int  # the longest sequence after the step
    sampled: list[int]  # index into the step's sequences of each sampled row
    # [S' + P + D] int64, flat row of each sampled sequence's last token, then prompt rows,
    # then draft rows
    sample_idx: np.ndarray
    # (sequence index, positions) of the prompt-logprob rows, in order
    prompt_rows: list[tuple[int, range]]
    draft_rows: list[tuple[int, int]]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [S' + P + D] int64, flat row of each sampled sequence's last token, then prompt rows,
    # then draft rows
    sample_idx: torch.Tensor
    sampled: list[int]  # index into the step's sequences of each sampled row
    # (sequence index, positions) of the prompt-logprob rows, in order
    prompt_rows: list[tuple[int, range]]
    draft_rows: list[tuple[int, int]]
    # (LoRA adapter name, its flat rows: a slice where they are side by side, else [n] int64) per
    # distinct adapter in the step
    adapter_rows: list[tuple[str, slice | torch.Tensor]] = field(default_factory=list)


def workspace_bytes(max_step_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """Bytes the input buffers take in the pool (for sizing it)."""
    total = 0
    for dtype, kind in _BUFFERS.values():
        size = torch.empty((), dtype=dtype).element_size()
        total += _length(kind, max_step_tokens, max_seqs, max_blocks) * size + 256
    return total


def _length(kind: str, max_step_tokens: int, max_seqs: int, max_blocks: int) -> int:
    return {
        "tokens": max_step_tokens,
        "seqs": max_seqs,
        "seqs+1": max_seqs + 1,
        "rows": max(max_step_tokens, max_seqs),
        "seqs*blocks": max_seqs * max_blocks,
    }[kind]


class InputBuilder:
    """Fills the pool-carved input buffers for one step."""

    def __init__(
        self,
        pool: DevicePool,
        staging: DevicePool | None,
        max_step_tokens: int,
        max_seqs: int,
        max_blocks: int,
        block_size: int,
        vocab_size: int,
        max_model_len: int,
        num_pages: int,
    ) -> None:
        self.max_step_tokens, self.max_seqs, self.max_blocks = max_step_tokens, max_seqs, max_blocks
        self.num_pages = num_pages
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len
        self.device = pool.device
        self._dev: dict[str, torch.Tensor] = {}
        self._staging: dict[str, torch.Tensor] = {}  # only when the device is not the host
        self._host: dict[str, np.ndarray] = {}  # numpy views the step writes into
        for name, (dtype, kind) in _BUFFERS.items():
            shape = (_length(kind, max_step_tokens, max_seqs, max_blocks),)
            self._dev[name] = pool.carve(f"inputs.{name}", shape, dtype)
            if staging is not None:  # CUDA: pinned host staging, copied asynchronously
                self._staging[name] = staging.carve(f"staging.{name}", shape, dtype)
                self._host[name] = self._staging[name].numpy()
            else:  # CPU: write straight into the pool buffer
                self._host[name] = self._dev[name].numpy()
        # the block table each row of block_tables holds at width max_blocks (build_decode), or None
        self._rows: list[list[int] | None] = [None] * max_seqs
        # tokens each row's table holds (the last build_decode)
        self._capacity = np.zeros(0, dtype=np.int64)

    def build_decode(self, seqs: list[ScheduledSequence], padded: int) -> DecodeInputs:
        """Inputs of a decode-only step (one token per sequence), `padded` rows long.

        The persistent batch: buffers keep last step's rows, and a row whose request and block
        count are unchanged keeps its block table (the usual decode step rewrites none); tokens,
        positions, lengths and slots are a few vectorised writes, then one copy to the device.
        """
        num_seqs = len(seqs)
        if num_seqs > padded or padded > self.max_seqs:
            raise ValueError(
                f"decode step of {num_seqs} sequences padded to {padded} exceeds the executor's "
                f"buffers ({self.max_seqs}): the scheduler must respect max_batch"
            )
        host, width, page = self._host, self.max_blocks, self.block_size
        tables = host["block_tables"][: padded * width].reshape(padded, width)
        rows = self._rows
        for i, seq in enumerate(seqs):
            table = seq.block_table
            if rows[i] != table:  # C-level list compare: a new request in this row, or a new block
                n = len(table)
                if n > width:
                    raise ValueError(
                        f"request {seq.req_id!r} has {n} KV blocks, beyond the {width} of "
                        f"max_model_len {self.max_model_len}"
                    )
                blocks = np.asarray(table, dtype=np.int32)
                if n and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_pages):
                    raise ValueError(
                        f"block ids must be in [0, {self.num_pages}), got "
                        f"{int(blocks.min())}..{int(blocks.max())}"
                    )
                tables[i, :n] = blocks
                rows[i] = list(table)
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
        tokens = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=num_seqs)
        if num_seqs and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(self._bad_token_message(seqs, tokens))
        if num_seqs and (int(pos.max()) >= self.max_model_len or int(pos.min()) < 0):
            raise ValueError(
                f"decode positions must be in [0, {self.max_model_len}) (max_model_len), got "
                f"{int(pos.min())}..{int(pos.max())}"
            )
        counts = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=num_seqs)
        if num_seqs and np.any(pos // page >= counts):
            bad = int(np.argmax(pos // page >= counts))
            raise ValueError(
                f"request {seqs[bad].req_id!r} needs {int(pos[bad]) // page + 1} KV blocks for "
                f"{int(pos[bad]) + 1} tokens but its block table has {int(counts[bad])}"
            )
        # tokens the block tables hold: advance_decode stays within them
        self._capacity = counts * page
        slots = tables[np.arange(num_seqs), pos // page].astype(np.int64) * page + pos % page
        _write_present_to_null(seqs, slots, range(num_seqs))
        for name, value, pad in (
            ("token_ids", tokens, 0),
            ("positions", pos, 0),
            ("slot_mapping", slots, 0),
            ("seq_lens", pos + 1, 1),
        ):
            buf = host[name]
            buf[:num_seqs] = value
            # padding: token 0 at position 0, written to slot 0 (null page)
            buf[num_seqs:padded] = pad
        for i in range(num_seqs, padded):
            if rows[i] is not None:  # a padding row reads page 0 only
                tables[i, 0] = 0
                rows[i] = None
        views = {}
        for name in ("token_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            n = padded * width if name == "block_tables" else padded
            dev = self._dev[name][:n]
            if self._staging:
                dev.copy_(self._staging[name][:n], non_blocking=True)
            views[name] = dev
        return DecodeInputs(
            views["token_ids"],
            views["positions"],
            views["slot_mapping"],
            views["block_tables"].view(padded, width),
            views["seq_lens"],
            num_seqs,
        )

    def advance_decode(self, step: DecodeInputs, tokens: list[int]) -> None:
        """Turn `step` (built by build_decode) into the next decode step of the same sequences: the
        sampled `tokens` in, every position one further, within the block tables it was built with."""
        n, page, host = step.num_seqs, self.block_size, self._host
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.shape != (n,) or (n and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size)):
            raise ValueError(
                f"a run's next tokens must be {n} ids in [0, {self.vocab_size}), got {tokens!r}"
            )
        pos = host["positions"][:n]
        pos += 1
        if n and (int(pos.max()) >= self.max_model_len or np.any(pos >= self._capacity)):
            raise ValueError(
                "a run of decode steps went past its block tables or max_model_len: the scheduler "
                "must allocate the whole run"
            )
        width = self.max_blocks
        tables = host["block_tables"][: step.input_ids.shape[0] * width].reshape(-1, width)
        host["token_ids"][:n] = ids
        host["seq_lens"][:n] = pos + 1
        host["slot_mapping"][:n] = (
            tables[np.arange(n), pos // page].astype(np.int64) * page + pos % page
        )
        if self._staging:
            for name in ("token_ids", "positions", "slot_mapping", "seq_lens"):
                self._dev[name][:n].copy_(self._staging[name][:n], non_blocking=True)

    def _bad_token_message(self, seqs: list[ScheduledSequence], tokens: np.ndarray) -> str:
        """Which id is out of range, in which request, and the vocabulary size."""
        at = int(np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))[0])
        for seq in seqs:
            if at < len(seq.token_ids):
                break
            at -= len(seq.token_ids)
        return (
            f"token id {int(seq.token_ids[at])} of request {seq.req_id!r} is outside the model's vocabulary "
            f"of {self.vocab_size} tokens: token ids must be in [0, {self.vocab_size})"
        )

    def build_rows(self, seqs: list[ScheduledSequence]) -> TokenRows:
        """`seqs` (prefill chunks and decode tokens mixed) as one row per token (a CPU step of at
        most a few dozen tokens: its arrays are built fresh, like the flat path's metadata)."""
        flat = self._flat(seqs)
        arrays = flat.arrays
        return TokenRows(
            torch.from_numpy(flat.tokens),
            torch.from_numpy(arrays.positions),
            torch.from_numpy(arrays.slot_mapping),
            torch.from_numpy(np.repeat(arrays.block_tables, flat.query_lens, axis=0)),
            torch.from_numpy((arrays.positions + 1).astype(np.int32)),
            torch.from_numpy(flat.sample_idx),
            flat.sampled,
            flat.prompt_rows,
            flat.draft_rows,
        )

    def _flat(self, seqs: list[ScheduledSequence]) -> _FlatStep:
        """The step's metadata arrays (slots of present K/V on the null page), token ids and sampled
        rows, every value checked against the buffers, the vocabulary and the pool."""
        num_seqs = len(seqs)
        query_lens = [len(s.token_ids) for s in seqs]
        num_tokens = sum(query_lens)
        start_pos = [s.start_pos for s in seqs]
        tables = [s.block_table for s in seqs]
        width = max(len(t) for t in tables)
        if num_seqs > self.max_seqs or num_tokens > self.max_step_tokens or width > self.max_blocks:
            raise ValueError(
                f"step of {num_seqs} sequences / {num_tokens} tokens / {width} blocks exceeds the executor's "
                f"buffers ({self.max_seqs} / {self.max_step_tokens} / {self.max_blocks}): the scheduler must respect "
                "max_batch, max_batched_tokens and max_model_len"
            )
        if min(query_lens) < 1:
            raise ValueError("every scheduled sequence needs at least one token to compute")
        arrays = build_arrays(query_lens, start_pos, tables, self.block_size, max_blocks=width)
        tokens = np.fromiter(
            chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=num_tokens
        )
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError(self._bad_token_message(seqs, tokens))
        max_len = int(arrays.seq_lens.max())
        if max_len > self.max_model_len:
            raise ValueError(
                f"a sequence reaches {max_len} tokens, beyond max_model_len {self.max_model_len}"
            )
        if int(arrays.block_tables.max()) >= self.num_pages or int(arrays.block_tables.min()) < 0:
            raise ValueError(
                f"block ids must be in [0, {self.num_pages}), got "
                f"{int(arrays.block_tables.min())}..{int(arrays.block_tables.max())}"
            )
        _write_present_to_null(seqs, arrays.slot_mapping, arrays.cu_seqlens_q.tolist())
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        sample_idx = arrays.cu_seqlens_q[1:][sampled].astype(np.int64) - 1
        prompt_rows = [
            (i, r)
            for i, s in enumerate(seqs)
            if s.context is not None and (r := s.prompt_logprob_rows)
        ]
        if prompt_rows:  # every row that scores a prompt token, after the sampled ones
            firsts = arrays.cu_seqlens_q
            extra = [
                np.arange(r.start, r.stop) - seqs[i].start_pos + firsts[i] for i, r in prompt_rows
            ]
            sample_idx = np.concatenate([sample_idx, *extra]).astype(np.int64)
        draft_rows = [(i, k) for i in sampled if (k := seqs[i].num_drafts)]
        if draft_rows:  # the rows before each verifying sequence's last: they score its drafts
            ends = arrays.cu_seqlens_q[1:]
            extra = [np.arange(ends[i] - 1 - k, ends[i] - 1) for i, k in draft_rows]
            sample_idx = np.concatenate([sample_idx, *extra]).astype(np.int64)
        return _FlatStep(
            arrays,
            tokens,
            query_lens,
            start_pos,
            tables,
            max_len,
            sampled,
            sample_idx,
            prompt_rows,
            draft_rows,
        )

    def build(self, seqs: list[ScheduledSequence]) -> StepInputs:
        """Flat inputs and attention metadata for `seqs` (prefill chunks and decode tokens mixed)."""
        flat = self._flat(seqs)
        arrays, num_seqs, width = flat.arrays, len(seqs), flat.arrays.block_tables.shape[1]
        values = {
            "token_ids": flat.tokens,
            "positions": arrays.positions,
            "slot_mapping": arrays.slot_mapping,
            "cu_seqlens": arrays.cu_seqlens_q,
            "seq_lens": arrays.seq_lens,
            "start_pos": arrays.start_pos,
            "sample_idx": flat.sample_idx,
            "block_tables": arrays.block_tables.reshape(-1),
        }
        self._rows[:num_seqs] = [None] * num_seqs  # the rows are rewritten below, at another width
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
            max_seqlen_q=max(flat.query_lens),
            max_seqlen_k=flat.max_len,
            cu_seqlens_q_list=arrays.cu_seqlens_q.tolist(),
            seq_lens_list=arrays.seq_lens.tolist(),
            start_pos_list=flat.start_pos,
            block_tables_list=flat.tables,
            block_size=self.block_size,
        )
        return StepInputs(
            views["token_ids"],
            views["positions"],
            meta,
            views["sample_idx"],
            flat.sampled,
            flat.prompt_rows,
            flat.draft_rows,
            _adapter_rows(seqs, arrays.cu_seqlens_q, self.device),
        )


def _adapter_rows(
    seqs: list[ScheduledSequence], firsts: np.ndarray, device: torch.device
) -> list[tuple[str, slice | torch.Tensor]]:
    """(adapter, flat rows of its sequences' tokens) per distinct adapter, in first-seen order: a
    slice where its sequences are side by side (the runner orders them so), else an index tensor."""
    rows: dict[str, list[np.ndarray]] = {}
    for i, seq in enumerate(seqs):
        if seq.sampling.adapter is not None:
            rows.setdefault(seq.sampling.adapter, []).append(np.arange(firsts[i], firsts[i + 1]))
    groups: list[tuple[str, slice | torch.Tensor]] = []
    for name, parts in rows.items():
        flat = np.concatenate(parts).astype(np.int64)
        if flat[-1] - flat[0] + 1 == flat.shape[0]:
            groups.append((name, slice(int(flat[0]), int(flat[-1]) + 1)))
        else:
            # NOTE: a small tensor per step (plain tensors in this slice, see docs/design/lora.md)
            groups.append((name, torch.from_numpy(flat).to(device)))
    return groups


def _write_present_to_null(seqs: list[ScheduledSequence], slot_mapping: np.ndarray, firsts) -> None:
    """Point the slots of each sequence's kv_present leading tokens (starting at flat row
    firsts[i]) at the null page: a shared block already holds their K/V (see sloserve.sched.output)."""
    for seq, first in zip(seqs, firsts, strict=False):  # cu_seqlens has one more entry
        if seq.kv_present:
            slot_mapping[first : first + seq.kv_present] = 0
