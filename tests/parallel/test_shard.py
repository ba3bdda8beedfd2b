"""Sharding without processes: which sizes split a model, and that the ranks' parts make up each weight."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sloserve.models.loader import load_checkpoint
from sloserve.models.shard import Shard, check_divisible, local_spec
from sloserve.models.spec import load_spec

CPU = torch.device("cpu")


def _load(folder, rank: int, size: int):
    return load_checkpoint(folder, CPU, torch.float32, shard=Shard(rank, size))


@pytest.mark.parametrize(
    ("overrides", "size", "needle"),
    [
        ({}, 3, "does not divide num_attention_heads 4"),
        ({"intermediate_size": 130}, 4, "does not divide intermediate_size 130"),
        (
            {"num_heads": 6, "num_kv_heads": 3},
            2,
            "num_key_value_heads 3 of LlamaForCausalLM do not split evenly",
        ),
        (
            {"num_heads": 12, "num_kv_heads": 3},
            4,
            "num_key_value_heads 3 of LlamaForCausalLM do not split evenly",
        ),
    ],
)
def test_sizes_that_do_not_split_are_refused(tiny_llama, overrides, size, needle):
    spec = dataclasses.replace(load_spec(tiny_llama), **overrides)
    with pytest.raises(ValueError, match=needle):
        check_divisible(spec, size)


def test_moe_sizes_are_checked(tiny_qwen2_moe):
    spec = dataclasses.replace(load_spec(tiny_qwen2_moe), moe_intermediate_size=30)
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size 30"):
        check_divisible(spec, 4)


@pytest.mark.parametrize(
    ("kv_heads", "size", "local_kv"), [(2, 2, 1), (2, 4, 1), (4, 2, 2), (1, 4, 1)]
)
def test_local_spec_splits_heads_and_replicates_kv_heads_when_fewer(
    make_checkpoint, kv_heads, size, local_kv
):
    spec = load_spec(
        make_checkpoint("llama", num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=8)
    )
    local = local_spec(spec, size)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
        8 // size,
        local_kv,
        128 // size,
    )
    # every rank's query heads read only the KV heads it holds
    group = spec.num_heads // spec.num_kv_heads
    for rank in range(size):
        shard = Shard(rank, size)
        q, kv = shard.q_heads(spec), shard.kv_heads(spec)
        assert {h // group for h in range(q.start, q.stop)} <= set(range(kv.start, kv.stop))


def _rows(t: torch.Tensor, dim: int, parts: list[torch.Tensor]) -> None:
    assert torch.equal(torch.cat(parts, dim=dim), t)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_rank_parts_make_up_the_whole_weights(make_checkpoint, arch):
    folder = (
        make_checkpoint(arch)
        if arch != "llama"
        else make_checkpoint(arch, attention_bias=True, mlp_bias=True)
    )
    spec, whole = _load(folder, 0, 1)
    ranks = [_load(folder, r, 2) for r in range(2)]
    q, kv = spec.q_size, spec.kv_size
    for i, layer in enumerate(whole.layers):
        parts = [w.layers[i] for _, w in ranks]
        # qkv: each rank holds its q rows, then its k and v rows
        qkv = [p.qkv.weight.split([q // 2, kv // 2, kv // 2]) for p in parts]
        for j, full in enumerate(layer.qkv.weight.split([q, kv, kv])):
            _rows(full, 0, [x[j] for x in qkv])
        _rows(layer.o.weight, 1, [p.o.weight for p in parts])
        if layer.o.bias is not None:
            # added once, by rank 0
            assert torch.equal(parts[0].o.bias, layer.o.bias) and parts[1].o.bias is None
        if layer.gate_up is not None:
            for j in range(2):  # gate, then up
                _rows(
                    layer.gate_up.weight.chunk(2)[j],
                    0,
                    [p.gate_up.weight.chunk(2)[j] for p in parts],
                )
            _rows(layer.down.weight, 1, [p.down.weight for p in parts])
        if layer.router is not None:
            assert all(torch.equal(p.router.weight, layer.router.weight) for p in parts)
    for i, (w13, w2) in whole.experts.items():
        for j in range(2):
            _rows(w13.chunk(2, dim=1)[j], 1, [w.experts[i][0].chunk(2, dim=1)[j] for _, w in ranks])
        _rows(w2, 2, [w.experts[i][1] for _, w in ranks])
    for _, w in ranks:
        assert torch.equal(w.embed, whole.embed) and torch.equal(
            w.lm_head.weight, whole.lm_head.weight
        )


def test_replicated_kv_heads_are_the_group_heads(make_checkpoint):
    folder = make_checkpoint("llama", num_attention_heads=8, num_key_value_heads=1, head_dim=8)
    spec, whole = _load(folder, 0, 1)
    for rank in range(2):
        _, w = _load(folder, rank, 2)
        k = w.layers[0].qkv.weight[spec.q_size // 2 :]
        # the one KV head, whole, on every rank
        assert torch.equal(k, whole.layers[0].qkv.weight[spec.q_size :])
