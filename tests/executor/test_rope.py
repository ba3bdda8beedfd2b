"""Rotary frequencies equal transformers' for every supported rope type."""

from __future__ import annotations

import pytest
import torch
from sloserve.layers.rope import RopeSpec, apply_rope, inv_frequencies, rope_tables

CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, RopeSpec(theta=10000.0)),
    "linear": (
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
        RopeSpec(500.0, "linear", 4.0),
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
        RopeSpec(10000.0, "llama3", 8.0, 1.0, 4.0, 64),
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_inv_frequencies_match_transformers(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, spec = CASES[kind]
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    ours = inv_frequencies(spec, 64)
    if kind == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_apply_rope_rotates_pairs_half_apart():
    cos, sin = rope_tables(RopeSpec(theta=10000.0), 4, 8, "cpu", torch.float32)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    out = apply_rope(x, cos[3:4], sin[3:4])
    c, s = cos[3], sin[3]
    expected = torch.stack(
        [1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1], 3 * c[2] + 1 * s[2], 4 * c[3] + 2 * s[3]]
    )
    torch.testing.assert_close(out[0, 0], expected)
    torch.testing.assert_close(out.norm(), x.norm())  # a rotation keeps length
