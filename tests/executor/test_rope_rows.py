"""A step's rotary rows (RopeRows): transformers' rotation bit for bit, on the decoder's strided q/k view."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from sloserve.layers import rope  # noqa: E402
from sloserve.layers.rope import RopeRows, apply_rope  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, dim", [(1, 14, 2, 64), (5, 4, 2, 16), (300, 2, 1, 128)]
)
def test_rows_rotate_as_transformers_on_the_fused_projection_view(
    dtype, tokens, heads, kv_heads, dim
):
    gen = torch.Generator().manual_seed(tokens + heads + dim)
    table_cos = torch.randn(512, dim, generator=gen).to(dtype)
    table_sin = torch.randn(512, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    # q and k rotated together, a view of the fused qkv projection (rows strided past V)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    rows = RopeRows.gather(table_cos, table_sin, positions)
    got = rows.rotate(qk)
    cos, sin = table_cos[positions], table_sin[positions]
    q, k = qk[:, :heads].transpose(0, 1)[None], qk[:, heads:].transpose(0, 1)[None]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert torch.equal(got[:, :heads], want_q[0].transpose(0, 1))
    assert torch.equal(got[:, heads:], want_k[0].transpose(0, 1))
    assert torch.equal(got, apply_rope(qk, cos, sin))
    # float32 rows go to the C kernel where it is built; the rest rotate in torch ops
    assert (rows.signed_sin is None) == (dtype == torch.float32 and rope._kernel is not None)
