"""The CPU RMSNorm, rotary and int8 rescale kernels (`sloserve.hotpath._cpu_ops`) against their torch twins."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from sloserve.layers import norm, quant, rope  # noqa: E402

pytestmark = pytest.mark.skipif(
    norm._kernel is None or rope._kernel is None,
    reason="the compiled extensions are not built (or SLOSERVE_NO_EXTENSIONS)",
)


def torch_rms_norm(x, weight, eps):
    xf = x.double()
    return (weight.double() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).float()


def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("rows, dim", [(1, 256), (3, 7), (64, 704), (5, 8), (2, 1)])
def test_rms_norm_matches_float64_within_float32_rounding(rows, dim):
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    weight = torch.randn(dim, generator=gen)
    got = norm.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)
    # strided: torch ops
    traced = norm.rms_norm(x.t().contiguous().t(), weight, 1e-5) if rows > 1 else got
    torch.testing.assert_close(traced, got, rtol=2e-6, atol=2e-6)


def test_rms_norm_of_a_zero_row_is_zero_and_large_rows_stay_finite():
    x = torch.zeros(2, 16)
    x[1] = 1e18
    out = norm.rms_norm(x, torch.ones(16), 1e-6)
    assert torch.equal(out[0], torch.zeros(16)) and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("tokens, heads, dim", [(1, 6, 64), (7, 3, 16), (32, 2, 128), (2, 1, 2)])
def test_rope_equals_the_torch_formula_bit_for_bit_on_strided_rows(tokens, heads, dim):
    """The decoder's input is a view of the fused qkv projection: rows strided past V."""
    gen = torch.Generator().manual_seed(tokens + heads + dim)
    fused = torch.randn(tokens, (heads + 2) * dim, generator=gen)
    x = fused[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 50
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    got = rope.apply_rope(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, torch_rope(x, cos, sin))


def test_other_layouts_and_dtypes_take_the_torch_ops():
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    cos, sin = torch.ones(4, 8, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.float64)
    assert not rope._fits(x, cos, sin) and torch.equal(rope.apply_rope(x, cos, sin), x)
    assert not norm._fits(torch.randn(4, 8).t(), torch.ones(4))


@pytest.mark.skipif(quant._rescale is None, reason="the compiled extensions are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "out_f", "in_f"), [(1, 24, 16), (5, 67, 33), (64, 130, 48)])
def test_int8_rescale_gives_the_torch_ops_bits(monkeypatch, dtype, bias, rows, out_f, in_f):
    """W8A8's rescale in one C pass equals `(acc * (xs[:, None] * ws)).to(dtype) + bias` bit for
    bit, ties to even and large sums included."""
    gen = torch.Generator().manual_seed(rows * out_f + in_f)
    weight = torch.randn(out_f, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen).to(dtype) if bias else None
    proj = quant.Int8Linear.quantize(weight, b)
    x = (torch.randn(rows, in_f, generator=gen) * 50).to(dtype)
    monkeypatch.setattr(quant, "RESCALE_C_ELEMENTS", 1)
    got = proj(x)
    monkeypatch.setattr(quant, "_rescale", None)
    want = proj(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)
    # the twin itself: the formula, spelled out
    xq, xs = quant.quantize_rows(x)
    acc = torch._int_mm(xq, proj.qweight.t())
    formula = (acc * (xs[:, None] * proj.scale)).to(dtype)
    if b is not None:
        formula = formula + b
    assert torch.equal(want, formula)
