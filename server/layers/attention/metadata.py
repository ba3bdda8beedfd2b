"""Per-step attention inputs: where each sequence's queries sit in the flat batch and its KV pages.

Layout of one step's flat token batch (S sequences, T tokens)::

    tokens   [ seq0 chunk | seq1 chunk | ... | seqS-1 chunk ]     q[T, Hq, D]
    cu_seqlens_q = [0, len0, len0+len1, ..., T]
    seq i covers positions start_pos[i] .. seq_lens[i]-1; its query j sits at position
    start_pos[i] + j and sees keys 0 .. start_pos[i] + j (causal, aligned bottom-right).

The K/V of position p of seq i live in slot block_tables[i, p // page] * page + p % page of the
paged cache; slot_mapping[t] is that slot for flat token t (written before attention runs).
Block tables are padded with 0 (the null page, never read past seq_lens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Device tensors plus the same values as Python lists (for loops on the CPU)."""

    cu_seqlens_q: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32, context + new tokens
    start_pos: torch.Tensor  # [S] int32, position of each chunk's first token
    block_tables: torch.Tensor  # [S, maxB] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q_list: list[int]
    seq_lens_list: list[int]
    start_pos_list: list[int]
    block_tables_list: list[list[int]]  # unpadded, each covering its sequence's seq_len
    block_size: int
    # per-step values a backend derives once and reuses per layer
    memo: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_q_list[-1]

    def token_rows(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each token of q[T, ...]: its sequence, and its row in that sequence's chunk (int64)."""
        num_tokens = q.shape[0]
        cu = self.cu_seqlens_q.to(torch.long)
        seq_of_token = torch.repeat_interleave(
            torch.arange(self.num_seqs, device=q.device), cu[1:] - cu[:-1], output_size=num_tokens
        )
        return seq_of_token, torch.arange(num_tokens, device=q.device) - cu[seq_of_token]

    @property
    def decode_only(self) -> bool:
        """Every sequence contributes exactly one query token."""
        return self.max_seqlen_q == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        start_pos: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from plain lists (tests and simple callers; the runner fills pool buffers)."""
        arrays = build_arrays(query_lens, start_pos, block_tables, block_size)
        dev = torch.device(device)
        return cls(
            cu_seqlens_q=torch.from_numpy(arrays.cu_seqlens_q).to(dev),
            seq_lens=torch.from_numpy(arrays.seq_lens).to(dev),
            start_pos=torch.from_numpy(arrays.start_pos).to(dev),
            block_tables=torch.from_numpy(arrays.block_tables).to(dev),
            slot_mapping=torch.from_numpy(arrays.slot_mapping).to(dev),
            max_seqlen_q=max(query_lens, default=0),
            max_seqlen_k=int(arrays.seq_lens.max(initial=0)),
            cu_seqlens_q_list=arrays.cu_seqlens_q.tolist(),
            seq_lens_list=arrays.seq_lens.tolist(),
            start_pos_list=list(start_pos),
            block_tables_list=[list(b) for b in block_tables],
            block_size=block_size,
        )


@dataclass(slots=True)
class MetadataArrays:
    """Host-side numpy form of one step's metadata (positions included), built without token loops."""

    cu_seqlens_q: np.ndarray  # [S+1] int32
    seq_lens: np.ndarray  # [S] int32
    start_pos: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, maxB] int32
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64


def build_arrays(
    query_lens: list[int],
    start_pos: list[int],
    block_tables: list[list[int]],
    block_size: int,
    max_blocks: int | None = None,
) -> MetadataArrays:
    """Vectorised metadata: positions and slots of every token from per-sequence values."""
    num_seqs = len(query_lens)
    if not (len(start_pos) == len(block_tables) == num_seqs):
        raise ValueError("query_lens, start_pos and block_tables must have one entry per sequence")
    qlens = np.asarray(query_lens, dtype=np.int64)
    starts = np.asarray(start_pos, dtype=np.int64)
    seq_lens = starts + qlens
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=cu[1:])
    width = max((len(b) for b in block_tables), default=0)
    if max_blocks is not None:
        width = max_blocks
    table = np.zeros((num_seqs, max(width, 1)), dtype=np.int32)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = blocks
    needed = (seq_lens + block_size - 1) // block_size
    lengths = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=num_seqs)
    if np.any(needed > lengths):
        bad = int(np.argmax(needed > lengths))
        raise ValueError(
            f"sequence {bad} needs {int(needed[bad])} KV blocks for {int(seq_lens[bad])} tokens "
            f"but its block table has {int(lengths[bad])}"
        )
    total = int(cu[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), qlens)
    positions = starts[seq_of_token] + (np.arange(total) - cu[:-1][seq_of_token])
    pages = table[seq_of_token, positions // block_size].astype(np.int64)
    slots = pages * block_size + positions % block_size
    return MetadataArrays(
        cu_seqlens_q=cu.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        start_pos=starts.astype(np.int32),
        block_tables=table,
        positions=positions,
        slot_mapping=slots,
    )
