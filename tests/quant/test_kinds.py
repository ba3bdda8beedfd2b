"""The quantized checkpoints' kinds (layers/int4.py, w8a16.py, w8a8.py) against plain-torch
products of the weight their format defines, on both sides of each kind's DEQUANT_ROWS, and what
they hold."""

from __future__ import annotations

import pytest
import torch
from sloserve.layers.int4 import (
    CONVERT_ROWS,
    DEQUANT_ROWS,
    GROUP_SIZES,
    Int4Linear,
    layout_known,
    unpack_rows,
)
from sloserve.layers.w8a8 import TokenW8A8Linear
from sloserve.layers.w8a16 import DEQUANT_ROWS as W8A16_DEQUANT_ROWS
from sloserve.layers.w8a16 import W8A16Linear
from sloserve.models.ct_fp8 import fp8_dequantized

# each side of both kinds' switch from the int kernel to dequantized tiles
ROWS = tuple(
    sorted({1, 3, 600} | {n + d for n in (DEQUANT_ROWS, W8A16_DEQUANT_ROWS) for d in (-1, 0)})
)


def _int4(out_f: int, in_f: int, group: int | None, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else in_f // group
    q = torch.randint(-8, 8, (out_f, in_f), generator=g, dtype=torch.int8)
    scale = torch.rand(out_f, groups, generator=g) / 10 + 0.01
    zp = None if symmetric else torch.randint(-8, 8, (out_f, groups), generator=g, dtype=torch.int8)
    zeros = torch.zeros_like(scale) if zp is None else zp.float()
    width = in_f // groups
    w = ((q.float().unflatten(1, (groups, width)) - zeros[..., None]) * scale[..., None]).flatten(1)
    return q, scale, zp, w


def test_unpack_reads_torchs_int4_layout_at_every_row_count():
    assert layout_known()
    for out_f in (80, 96, 112, 128, 208, 1152):
        values = torch.randint(0, 16, (out_f, 96), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        assert torch.equal(unpack_rows(packed, out_f, 96, 0, out_f).int(), values)
        assert torch.equal(unpack_rows(packed, out_f, 96, 64, out_f).int(), values[64:])


@pytest.mark.parametrize(
    ("out_f", "in_f", "group", "symmetric"),
    [(128, 64, 32, False), (208, 256, 64, True), (576, 256, 128, False), (96, 96, None, False)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_int4_products_equal_the_dequantized_weights_product(out_f, in_f, group, symmetric, bias):
    q, scale, zp, w = _int4(out_f, in_f, group, symmetric)
    b = torch.randn(out_f) if bias else None
    proj = Int4Linear.from_signed(q, scale, zp, b)
    assert proj.weight is None and proj.group_size in GROUP_SIZES
    torch.testing.assert_close(proj.dequantized(), w, rtol=0, atol=1e-6)
    for rows in ROWS:
        x = torch.randn(rows, in_f)
        want = x.double() @ w.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(proj(x).double(), want, rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 5, in_f)
    assert proj(x).shape == (2, 5, out_f)
    assert proj(x[:0]).shape == (0, 5, out_f)


def test_int4_bf16_products_stay_near_the_float32_ones():
    q, scale, zp, w = _int4(256, 256, 128, False)
    proj = Int4Linear.from_signed(q, scale, zp, dtype=torch.bfloat16)
    for rows in (1, DEQUANT_ROWS):
        x = torch.randn(rows, 256)
        got = proj(x.bfloat16()).float()
        want = x @ w.t()
        assert got.dtype == torch.float32 and (got - want).abs().max() < 0.05 * want.abs().max()


def test_int4_holds_under_a_third_of_bf16():
    q, scale, zp, _ = _int4(1152, 896, 128, False)
    proj = Int4Linear.from_signed(q, scale, zp, dtype=torch.bfloat16)
    assert proj.nbytes() <= 0.3 * 1152 * 896 * 2


def test_int4_refuses_shapes_its_kernel_cannot_run():
    q, scale, zp, _ = _int4(64, 96, None, True)
    with pytest.raises(ValueError, match="groups of 48 inputs"):
        Int4Linear.from_signed(q, scale.repeat(1, 2), None)
    with pytest.raises(ValueError, match="multiple of 16 output rows"):
        Int4Linear.from_signed(q[:40], scale[:40], None)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        Int4Linear.from_signed(q[:, :40], scale, None)


@pytest.mark.parametrize("zero_point", [False, True])
def test_w8a16_products_never_round_the_activations(zero_point):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (200, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(200, 1, generator=g) / 100
    zp = torch.randint(-20, 20, (200, 1), generator=g, dtype=torch.int8) if zero_point else None
    b = torch.randn(200)
    w = (q.float() - (0 if zp is None else zp.float())) * scale
    proj = W8A16Linear(q, scale, zp, b)
    for rows in ROWS:
        x = torch.randn(rows, 96)
        want = x.double() @ w.double().t() + b.double()
        torch.testing.assert_close(proj(x).double(), want, rtol=1e-5, atol=1e-4)
    assert proj.nbytes() == 200 * 96 + 200 * 4 * (3 if zero_point else 2)
    with pytest.raises(ValueError, match="2-D int8 CPU weight"):
        W8A16Linear(q.float(), scale)


def test_token_w8a8_rounds_each_activation_row_as_compressed_tensors_does():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (160, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(160, generator=g) / 100
    proj = TokenW8A8Linear(q, scale, None)
    for rows in (1, 3, 600):
        x = torch.randn(rows, 96)
        x[0] = 0  # an all-zero row takes the smallest scale, not a division by zero
        xs = x.abs().amax(dim=1, keepdim=True) / 127.5
        xs = torch.where(xs == 0, torch.finfo(torch.float32).eps, xs)
        xq = torch.round(x / xs).clamp(-128, 127)
        want = (xq.double() * xs.double()) @ (q.double() * scale.double()[:, None]).t()
        torch.testing.assert_close(proj(x).double(), want, rtol=1e-5, atol=1e-5)


def test_fp8_block_scales_cover_their_rows_and_columns():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(200, 72, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 1, generator=g) + 0.5  # blocks of 128 x 128: a partial one at the end
    got = fp8_dequantized(w, scale, "block", (128, 128))
    torch.testing.assert_close(got[:128], w[:128].float() * scale[0])
    torch.testing.assert_close(got[128:], w[128:].float() * scale[1])


def test_int4_converts_in_chunks_to_the_layout_of_one_conversion():
    values = torch.randint(0, 16, (CONVERT_ROWS * 2 + 80, 64), dtype=torch.int32)
    proj = Int4Linear(values, torch.ones(values.shape[0], 1), torch.zeros(values.shape[0], 1))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    assert torch.equal(proj.packed, whole)
