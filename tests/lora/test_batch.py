"""The grouped deltas on a fused projection equal the dense merged weight's product, whether an
adapter's rows are a slice or scattered; the runner puts each adapter's sequences side by side."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from sloserve.executor.runner import _by_adapter
from sloserve.lora import LoraBatch, LoraRegistry
from sloserve.models.spec import load_spec
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence


def _merged_qkv_delta(path, layer: int, scale: float) -> torch.Tensor:
    """scale * B @ A of q, k and v stacked as the fused projection's rows ([q + 2 kv, H])."""
    tensors = load_file(path / "adapter_model.safetensors")
    prefix = f"base_model.model.model.layers.{layer}.self_attn."
    return torch.cat(
        [
            scale * tensors[f"{prefix}{m}.lora_B.weight"] @ tensors[f"{prefix}{m}.lora_A.weight"]
            for m in ("q_proj", "k_proj", "v_proj")
        ]
    )


@pytest.mark.parametrize("scattered", [False, True])
def test_grouped_deltas_equal_the_merged_weights(make_checkpoint, make_lora, scattered):
    base = make_checkpoint("llama")
    paths = [make_lora("llama", rank=8, seed=1), make_lora("llama", rank=64, seed=2)]
    registry = LoraRegistry(load_spec(base), torch.float32, torch.device("cpu"), 256, None)
    adapters = [registry.load(f"a{i}", str(p), trusted=True) for i, p in enumerate(paths)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 64, generator=gen)
    weight = torch.randn(128, 64, generator=gen)
    if scattered:
        rows = [torch.tensor([0, 3, 4, 9]), torch.tensor([1, 2, 7])]
    else:
        rows = [slice(0, 4), slice(4, 7)]
    got = LoraBatch(list(zip(adapters, rows, strict=True))).apply(1, "qkv", x, x @ weight.T)
    want = x @ weight.T
    for path, r in zip(paths, rows, strict=True):
        merged = weight + _merged_qkv_delta(path, 1, 2.0)
        want[r] = x[r] @ merged.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # rows in no group keep the base product
    plain = [5, 6, 8] if scattered else [7, 8, 9]
    assert torch.equal(got[plain], (x @ weight.T)[plain])


def _seq(adapter: str | None) -> ScheduledSequence:
    return ScheduledSequence("r", [1], 0, [1], True, SamplingParams(adapter=adapter))


def test_the_runner_orders_sequences_so_each_adapter_is_one_slice():
    assert _by_adapter([_seq(None), _seq(None)]) is None
    assert _by_adapter([_seq(None), _seq("a"), _seq("a"), _seq("b")]) is None
    assert _by_adapter([_seq("a"), _seq(None), _seq("b"), _seq("a"), _seq(None)]) == [1, 4, 0, 3, 2]
