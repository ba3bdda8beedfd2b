"""Dense projections through oneDNN, on plain and packed weights (layers/linear.py), against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sloserve.layers.linear import (
    MIN_PACKED_ROWS,
    TILE_ROWS,
    DenseLinear,
    OneDnnLinear,
    PackedLinear,
    cpu_gemm_reason,
    on_onednn,
    onednn_available,
    onednn_product,
    row_tiles,
)

from tests.executor.conftest import runner_config

needs_onednn = pytest.mark.skipif(
    not onednn_available(), reason="this torch build has no oneDNN linear operators"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(512, 256), (24, 40), (7, 3)])
def test_packed_product_matches_float64(shape, bias):
    torch.manual_seed(0)
    w = torch.randn(shape)
    b = torch.randn(shape[0]) if bias else None
    kinds = (OneDnnLinear(w, b), PackedLinear(w, b))
    for rows in (1, MIN_PACKED_ROWS - 1, MIN_PACKED_ROWS, 100):
        x = torch.randn(rows, shape[1])
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        for got in (*(proj(x) for proj in kinds), onednn_product(x, w, b)):
            assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


@needs_onednn
def test_a_row_is_the_same_whatever_the_row_count_from_the_threshold_up():
    torch.manual_seed(1)
    w = torch.randn(1408, 256)
    for packed in (OneDnnLinear(w), PackedLinear(w)):
        x = torch.randn(700, 256)
        whole = packed(x)
        for rows in (MIN_PACKED_ROWS, 17, 64, 333, 512, 699):
            assert torch.equal(packed(x[:rows].contiguous()), whole[:rows])


def test_row_tiles_cover_every_row_once_with_a_few_sizes():
    for rows in range(1, 3000):
        tiles = row_tiles(rows)
        starts = [start for start, _ in tiles]
        assert starts == sorted(starts) and starts[0] == 0
        for (start, size), nxt in zip(tiles, [*starts[1:], None], strict=True):
            assert size in TILE_ROWS
            assert nxt is None or start + size == nxt
        last_start, last_size = tiles[-1]
        # only the last runs past, padded
        assert rows <= last_start + last_size < rows + TILE_ROWS[-1]
        assert len(tiles) <= rows // TILE_ROWS[0] + len(TILE_ROWS)


@needs_onednn
def test_what_is_not_packed_or_too_small_runs_f_linear():
    torch.manual_seed(2)
    w, other = torch.randn(32, 16), torch.randn(32, 16)
    packed = OneDnnLinear(w)
    x = torch.randn(MIN_PACKED_ROWS - 1, 16)
    assert torch.equal(packed(x), F.linear(x, w))  # too few rows: bit for bit F.linear
    big = torch.randn(40, 16)
    assert torch.equal(DenseLinear(other)(big), F.linear(big, other))  # not packed
    assert torch.equal(packed(big[None]), F.linear(big[None], w))  # not 2-D
    assert packed.weight is w and packed.nbytes() == 32 * 16 * 4


def test_only_float32_cpu_matrices_are_packed_as_float32():
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        PackedLinear(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        OneDnnLinear(torch.randn(4))


def test_cpu_gemm_reason():
    cpu = torch.device("cpu")
    assert cpu_gemm_reason("blas", cpu, torch.float32) == "--cpu-gemm blas"
    assert "float32 and bfloat16 on a CPU" in cpu_gemm_reason("auto", cpu, torch.float16)
    assert "float32 and bfloat16 on a CPU" in cpu_gemm_reason(
        "onednn", torch.device("cuda"), torch.float32
    )
    assert cpu_gemm_reason("auto", cpu, torch.float32) == (
        None if onednn_available() else "this torch build has no oneDNN linear operators"
    )
    with pytest.raises(ValueError, match="cpu gemm must be one of"):
        cpu_gemm_reason("mkl", cpu, torch.float32)


def test_the_runner_packs_on_auto_and_refuses_onednn_where_it_cannot(make_checkpoint, make_runner):
    folder = make_checkpoint("llama")
    auto = make_runner(folder)
    assert on_onednn(auto.model.weights.layers[0].qkv) == onednn_available()
    assert type(make_runner(folder, cpu_gemm="blas").model.weights.layers[0].qkv) is DenseLinear
    # auto falls back (bfloat16 packs: test_bf16.py)
    assert type(make_runner(folder, dtype="float16").model.weights.layers[0].qkv) is DenseLinear
    with pytest.raises(ValueError, match="--cpu-gemm onednn cannot run here"):
        make_runner(folder, dtype="float16", cpu_gemm="onednn")


def test_config_refuses_an_unknown_cpu_gemm(tmp_path):
    with pytest.raises(ValueError, match="cpu gemm must be auto, onednn or blas"):
        runner_config(tmp_path, cpu_gemm="mkl")
