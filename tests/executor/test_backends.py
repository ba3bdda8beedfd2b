"""Every attention backend against a float64 oracle over the same paged cache.

Cases: context lengths 1, page-1, page, page+1, 3*page+5; GQA ratios 1, 4, 8; whole prefills,
decode tokens and prefill chunks after cached context, alone and mixed in one batch; pages
handed out in shuffled order. GPU-only backends run under the `gpu` marker.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from sloserve.layers.attention import paged
from sloserve.layers.attention.metadata import AttentionMetadata
from sloserve.layers.attention.sdpa import SdpaBackend

PAGE = 16
HEAD_DIM = 32
KV_HEADS = 2
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5]
RATIOS = [1, 4, 8]
CUDA = torch.cuda.is_available()
PAGED_KERNEL = paged.AVAILABLE


def cpu_backends() -> list[tuple[str, object]]:
    """(id, backend) for every backend that runs on a CPU."""
    found: list[tuple[str, object]] = [
        ("sdpa-split-gather", SdpaBackend(batched=False, inplace=False)),
        ("sdpa-batched", SdpaBackend(batched=True)),
    ]
    if PAGED_KERNEL:  # the in-place paged decode kernel (Cython); its twin is sdpa-split-gather
        found.append(("sdpa-split-inplace", SdpaBackend(batched=False, inplace=True)))
    try:
        from sloserve.layers.attention import get_backend
    except ImportError:
        return found
    try:
        found.append(("reference", get_backend("reference", "cpu")))
    except (ValueError, RuntimeError, KeyError):
        pass
    return found


BACKENDS = cpu_backends()


def make_case(
    chunks: list[tuple[int, int]],
    ratio: int,
    *,
    seed: int = 0,
    dtype=torch.float32,
    device="cpu",
    page: int = PAGE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float]:
    """Random q and paged caches for sequences given as (start_pos, query_len); pages shuffled."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [math.ceil((s + n) / page) for s, n in chunks]
    num_pages = sum(pages_needed) + 3  # + null page 0 and two pages nobody uses
    page_ids = list(range(1, num_pages))
    random.Random(seed).shuffle(page_ids)
    tables, at = [], 0
    for n in pages_needed:
        tables.append(page_ids[at : at + n])
        at += n
    k_cache = torch.randn(num_pages, page, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, KV_HEADS * ratio, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata.build(
        [n for _, n in chunks], [s for s, _ in chunks], tables, page, device
    )
    return q.to(device), k_cache.to(device), v_cache.to(device), meta, HEAD_DIM**-0.5


def oracle(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Dense float64 attention per sequence: the query at position p sees keys 0..p of its sequence."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    group = q.shape[1] // k_cache.shape[2]
    page = meta.block_size
    flat_k = k_cache.flatten(0, 1)  # [P * page, Hkv, D], row = slot
    flat_v = v_cache.flatten(0, 1)
    out = torch.zeros_like(q)
    cu = meta.cu_seqlens_q_list
    for i, table in enumerate(meta.block_tables_list):
        seq_len = meta.seq_lens_list[i]
        slots = torch.tensor([table[p // page] * page + p % page for p in range(seq_len)])
        k = flat_k[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = flat_v[slots].repeat_interleave(group, dim=1)
        positions = torch.arange(cu[i + 1] - cu[i]) + meta.start_pos_list[i]
        scores = torch.einsum("thd,lhd->htl", q[cu[i] : cu[i + 1]], k) * scale
        scores = scores.masked_fill(
            torch.arange(seq_len)[None, None, :] > positions[None, :, None], -math.inf
        )
        out[cu[i] : cu[i + 1]] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


def modes(length: int) -> dict[str, tuple[int, int]]:
    """(start_pos, query_len) of a whole prefill, a decode token and a chunk, all ending at `length`."""
    half = length // 2
    return {"prefill": (0, length), "decode": (length - 1, 1), "chunk": (half, length - half)}


@pytest.mark.parametrize("backend", [b for _, b in BACKENDS], ids=[i for i, _ in BACKENDS])
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("mode", ["prefill", "decode", "chunk"])
def test_single_sequence_matches_oracle(backend, ratio, length, mode):
    q, k, v, meta, scale = make_case([modes(length)[mode]], ratio, seed=length * 10 + ratio)
    out = backend.forward(q, k, v, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, oracle(q, k, v, meta, scale)) <= 1e-5


@pytest.mark.parametrize("backend", [b for _, b in BACKENDS], ids=[i for i, _ in BACKENDS])
@pytest.mark.parametrize("ratio", RATIOS)
def test_mixed_prefill_and_decode_in_one_batch(backend, ratio):
    chunks = [m for length in LENGTHS for m in modes(length).values()]
    random.Random(ratio).shuffle(chunks)
    q, k, v, meta, scale = make_case(chunks, ratio, seed=ratio)
    out = backend.forward(q, k, v, meta, scale)
    ref = oracle(q, k, v, meta, scale)
    assert rel_err(out, ref) <= 1e-5
    # Each sequence's rows are its own: a per-sequence error check catches a swapped row block.
    cu = meta.cu_seqlens_q_list
    for i in range(meta.num_seqs):
        assert rel_err(out[cu[i] : cu[i + 1]], ref[cu[i] : cu[i + 1]]) <= 1e-5


def leak_cases() -> list:
    """(backend, chunks) pairs: prefill chunks, decodes of unequal lengths beside a prefill, decodes alone."""
    cases = (
        ("mixed", [(0, 5), (PAGE, 3)]),
        (
            "split",
            [(0, 5), (PAGE + 2, 1), (4, 1)],
        ),  # the short decode's padding reads the null page
        ("decode", [(4, 1), (PAGE + 2, 1)]),
    )
    return [
        pytest.param(backend, chunks, id=f"{case_id}-{name}")
        for name, backend in BACKENDS
        for case_id, chunks in cases
    ]


@pytest.mark.parametrize(("backend", "chunks"), leak_cases())
def test_unrelated_pages_do_not_leak_into_the_output(backend, chunks):
    q, k, v, meta, scale = make_case(chunks, 4, seed=7)
    used = {b for table in meta.block_tables_list for b in table}
    k2, v2 = k.clone(), v.clone()
    for page in range(k.shape[0]):
        if page not in used:
            k2[page] = float("nan")
            v2[page] = float("inf")
    # Slots past each sequence's length inside its last page may hold garbage too (the pool is
    # never cleared): they must not reach the output, not even as 0 * NaN.
    last = meta.block_tables_list[0][-1]
    k2[last, 5:] = float("nan")
    v2[last, 5:] = float("nan")
    assert torch.equal(
        backend.forward(q, k, v, meta, scale), backend.forward(q, k2, v2, meta, scale)
    )


def test_reference_per_head_decode_path_does_not_leak(monkeypatch):
    """The wide-GQA decode path (more kv heads than the folded path takes) zeroes garbage too."""
    from sloserve.layers.attention import reference

    monkeypatch.setattr(reference, "_MAX_FOLDED_KV_HEADS", 1)
    test_unrelated_pages_do_not_leak_into_the_output(
        reference.ReferenceBackend(), [(4, 1), (PAGE + 2, 1)]
    )
    q, k, v, meta, scale = make_case([(4, 1), (PAGE + 2, 1)], 4, seed=3)
    assert (
        rel_err(
            reference.ReferenceBackend().forward(q, k, v, meta, scale), oracle(q, k, v, meta, scale)
        )
        <= 1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("queries,keys", [(33, 33), (7, 50), (1, 70)])
def test_sdpa_gqa_reads_kv_heads_in_place_with_the_same_bits(dtype, queries, keys):
    """The CPU prefill path hands SDPA each KV head once (enable_gqa): bit-equal to K/V repeated per query head."""
    from sloserve.layers.attention.sdpa import _sdpa

    gen = torch.Generator().manual_seed(queries * 100 + keys)
    q = torch.randn(4, queries, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(2, keys, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    causal = queries == keys
    mask = None if causal else torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q[None],
        k.repeat_interleave(2, 0)[None],
        v.repeat_interleave(2, 0)[None],
        attn_mask=mask,
        scale=0.125,
        is_causal=causal,
    )[0]
    assert torch.equal(_sdpa(q, k, v, mask, 0.125, causal=causal), repeated)


@pytest.mark.parametrize(
    "chunks", [[(0, 3 * PAGE + 5)], [(PAGE + 3, 2 * PAGE)], [(2, 5), (0, PAGE + 1)]]
)
def test_sdpa_prefill_reads_consecutive_pages_in_place(chunks):
    """A prefill whose pages lie one after another reads its K/V as a view of the cache: the same bits
    as gathering shuffled pages (make_case's), and the oracle's values."""
    q, k_cache, v_cache, meta, scale = make_case(chunks, 4, seed=7)
    renumber = {
        old: new
        for new, old in enumerate((p for table in meta.block_tables_list for p in table), 1)
    }
    k_laid, v_laid = k_cache.clone(), v_cache.clone()
    for old, new in renumber.items():
        k_laid[new], v_laid[new] = k_cache[old], v_cache[old]
    tables = [[renumber[p] for p in table] for table in meta.block_tables_list]
    laid = AttentionMetadata.build(
        [n for _, n in chunks], [s for s, _ in chunks], tables, PAGE, "cpu"
    )
    backend = SdpaBackend(batched=False, inplace=False)
    shuffled_out = backend.forward(q, k_cache, v_cache, meta, scale)
    laid_out = backend.forward(q, k_laid, v_laid, laid, scale)
    assert all(isinstance(pages, slice) for _, _, _, pages, _ in laid.memo["sdpa.split"][0])
    # gathered
    assert any(not isinstance(pages, slice) for _, _, _, pages, _ in meta.memo["sdpa.split"][0])
    assert torch.equal(laid_out, shuffled_out)
    assert rel_err(laid_out, oracle(q, k_laid, v_laid, laid, scale)) <= 1e-5


def test_sdpa_rejects_bad_head_ratio():
    q, k, v, meta, scale = make_case([(0, 3)], 1, seed=1)  # KV_HEADS = 2 KV heads
    q3 = torch.randn(q.shape[0], 3, HEAD_DIM)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        SdpaBackend().forward(q3, k, v, meta, scale)


def test_gpu_backends_report_why_they_cannot_run_on_cpu():
    from sloserve.layers.attention.flash import FlashBackend
    from sloserve.layers.attention.triton_decode import TritonDecodeBackend

    assert "CUDA" in FlashBackend.unavailable_reason("cpu")
    assert "CUDA" in TritonDecodeBackend.unavailable_reason("cpu")
    assert SdpaBackend.unavailable_reason("cpu") is None


# -- GPU ----------------------------------------------------------------------------------------
# Each GPU test names the backend it checks. On a CUDA machine a named backend that cannot run
# (flash-attn or triton missing, a page size it refuses) FAILS the test with the reason: it is
# never dropped, so a green run means every named kernel ran. Without CUDA they skip.

GPU_BACKENDS = ("sdpa", "triton", "triton-split", "flash")  # triton-split: the flash-decoding path


def gpu_backend(name: str, dtype: torch.dtype, block_size: int) -> object:
    """The backend a GPU test names, built for these settings; pytest.fail with the reason when it cannot run."""
    from sloserve.layers.attention.flash import FlashBackend
    from sloserve.layers.attention.triton_decode import TritonDecodeBackend

    classes = {"sdpa": SdpaBackend, "triton": TritonDecodeBackend, "flash": FlashBackend}
    cls = classes[name.removesuffix("-split")]
    reason = cls.unavailable_reason("cuda", dtype, block_size, HEAD_DIM)
    if reason is not None:
        pytest.fail(
            f"{name} is named by this test but cannot run on this CUDA machine: {reason}",
            pytrace=False,
        )
    if name == "sdpa":
        return SdpaBackend(batched=True)
    if name == "triton-split":
        return TritonDecodeBackend(block_n=16, num_splits=3)
    return cls()


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_cpu_split_path_on_bf16_caches_matches_oracle(ratio, batch):
    """bf16 pages on a CPU: decode tokens attend in float32 matmuls (sdpa._decode_float32), prefill
    chunks on SDPA; both within bf16's rounding of the float64 oracle."""
    chunks = [m for length in LENGTHS for m in modes(length).values()]
    if batch == "decode":
        chunks = [(n - 1, 1) for n in LENGTHS]
    q, k, v, meta, scale = make_case(chunks, ratio, seed=ratio, dtype=torch.bfloat16)
    out = SdpaBackend(batched=False).forward(q, k, v, meta, scale)
    assert out.dtype == torch.bfloat16 and rel_err(out, oracle(q, k, v, meta, scale)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# flash needs 256-token pages: below
@pytest.mark.parametrize("name", [n for n in GPU_BACKENDS if n != "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_gpu_backends_match_oracle(name, dtype, ratio):
    backend = gpu_backend(name, dtype, PAGE)
    chunks = [m for length in LENGTHS for m in modes(length).values()]
    q, k, v, meta, scale = make_case(chunks, ratio, seed=ratio, dtype=dtype, device="cuda")
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(backend.forward(q, k, v, meta, scale), oracle(q, k, v, meta, scale)) <= tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_gpu_backends_with_256_token_pages(name, ratio, batch):
    """flash-attn's paged kernels need 256-token pages; decode-only and mixed batches."""
    backend = gpu_backend(name, torch.bfloat16, 256)
    lengths = [1, 255, 256, 257, 3 * 256 + 5]
    chunks = (
        [(n - 1, 1) for n in lengths]
        if batch == "decode"
        else [m for n in lengths for m in modes(n).values()]
    )
    q, k, v, meta, scale = make_case(
        chunks, ratio, seed=ratio, dtype=torch.bfloat16, device="cuda", page=256
    )
    assert rel_err(backend.forward(q, k, v, meta, scale), oracle(q, k, v, meta, scale)) <= 2e-2


def test_gpu_backend_helper_fails_instead_of_dropping(monkeypatch):
    """On CUDA a named backend that cannot run fails its test with the reason (checked here without a GPU)."""
    from sloserve.layers.attention import flash

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash, "_flash_importable", lambda: False)
    with pytest.raises(
        pytest.fail.Exception, match="flash is named by this test.*flash-attn is not installed"
    ):
        gpu_backend("flash", torch.bfloat16, 256)
    monkeypatch.setattr(flash, "_flash_importable", lambda: True)
    with pytest.raises(pytest.fail.Exception, match="multiple of 256, got 16"):
        gpu_backend("flash", torch.bfloat16, PAGE)
    assert isinstance(gpu_backend("sdpa", torch.bfloat16, PAGE), SdpaBackend)
