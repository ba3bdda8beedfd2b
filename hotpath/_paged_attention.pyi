"""Type stubs for the compiled `_paged_attention` module (its pure-torch twin is the gather path in sdpa.py)."""

def write_int8_rows(
    rows: int,
    cache: int,
    slots: int,
    num_tokens: int,
    heads: int,
    head_dim: int,
    num_slots: int,
) -> None:
    """cache[slots[t], h] = row h of token t quantized as kv_int8.quantize_rows does (data pointers:
    float32 rows, int64 slots, int8 cache rows of head_dim + 2 bytes)."""

def paged_decode(
    q: int,
    k_cache: int,
    v_cache: int,
    block_tables: int,
    seq_lens: int,
    out: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page: int,
    num_pages: int,
    table_width: int,
    scale: float,
    num_threads: int,
    kv_bf16: bool = False,
    kv_int8: bool = False,
) -> None:
    """out[S, Hq, D] = softmax(q k^T * scale) v over each sequence's pages, read in place (data
    pointers; q and out float32, the pages float32, bf16 with kv_bf16, or int8 rows and their
    scales with kv_int8)."""
