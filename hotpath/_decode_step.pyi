"""Type stubs for the compiled `_decode_step` module (its pure-torch twin is DecoderModel.decode)."""

def bf16_dot_products(enabled: bool | None = None) -> bool:
    """Whether bf16 products run on AVX512-BF16 dot products; False forces the widened path."""

def int8_vnni(enabled: bool | None = None) -> bool:
    """Whether int8 products run on AVX512-VNNI; False forces the widened int32 loop."""

def int4_avx512(enabled: bool | None = None) -> bool:
    """Whether int4 products run on AVX-512; False forces the scalar loop."""

class DecodeKernel:
    """A dense decoder's whole decode step in one nogil call; addresses of its weights and cache set
    once (weights and KV pages float32 or bf16: dims' weight_dtype and kv_dtype)."""

    def __init__(
        self,
        dims: dict[str, int | float | str],
        embed: int,
        norm: int,
        lm_head: int,
        cos: int,
        sin: int,
        layers: list[dict[str, int | str | None]],
        int8_head: dict[str, int | None] | None = None,
    ) -> None: ...
    def __call__(
        self,
        input_ids: int,
        positions: int,
        slots: int,
        block_tables: int,
        table_width: int,
        seq_lens: int,
        batch: int,
        logits: int,
        num_threads: int,
        logit_rows: int = 0,
        num_logit_rows: int = -1,
    ) -> int:
        """logits[batch, V] of one step of `batch` rows, one query token each (data pointers), or, with
        num_logit_rows >= 0, of the rows `logit_rows` names; ValueError on out-of-range inputs.
        Returns the caller's nanoseconds spent waiting for late team threads (0 on one thread)."""
