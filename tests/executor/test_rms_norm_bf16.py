"""RMSNorm of bf16 activations: transformers' LlamaRMSNorm, bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from sloserve.layers.norm import rms_norm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


@pytest.mark.parametrize("rows, dim", [(1, 896), (4, 896), (3, 7), (300, 64)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_rms_norm_equals_llama_rms_norm_bit_for_bit(rows, dim, weight_dtype):
    gen = torch.Generator().manual_seed(rows * 7 + dim)
    reference = LlamaRMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(dim, generator=gen) * 2)
    reference = reference.to(weight_dtype)
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(rows, dim, generator=gen) * scale).bfloat16()
        want = reference(x)
        got = rms_norm(x, reference.weight.detach(), 1e-6)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
