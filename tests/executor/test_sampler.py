"""Sampler: greedy is argmax, filters keep the right tokens, seeds reproduce regardless of batch."""

from __future__ import annotations

import pytest
import torch
from sloserve.layers.sampler import Sampler, filtered_probs
from sloserve.sampling_params import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]])


def test_greedy_is_argmax_per_row():
    sampler = Sampler("cpu", seed=0)
    assert sampler.sample(LOGITS, [SamplingParams(), SamplingParams()], ["a", "b"]) == [1, 3]


def test_top_k_keeps_the_k_best():
    probs = filtered_probs(LOGITS, [SamplingParams(temperature=1.0, top_k=2)] * 2)
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert (probs[1] > 0).tolist() == [True, False, False, True]
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def keep(p: float) -> list[bool]:
        return (filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=p)])[0] > 0).tolist()

    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]


def test_temperature_sharpens_and_flattens():
    cold = filtered_probs(LOGITS[:1], [SamplingParams(temperature=0.1)])[0]
    hot = filtered_probs(LOGITS[:1], [SamplingParams(temperature=10.0)])[0]
    assert cold[1] > 0.99 and hot.max() < 0.35


def test_seeded_requests_reproduce_regardless_of_batch_mates():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    alone = Sampler("cpu")
    solo = [alone.sample(logits, [params], ["x"])[0] for _ in range(20)]
    crowd_sampler = Sampler("cpu")
    crowd = []
    others = SamplingParams(temperature=1.0)
    for _ in range(20):
        batch = torch.cat([torch.randn(2, 50), logits, torch.randn(1, 50)])
        crowd.append(
            crowd_sampler.sample(batch, [others, others, params, others], ["o1", "o2", "x", "o3"])[
                2
            ]
        )
    assert solo == crowd
    assert len(set(solo)) > 1  # it really samples


def test_generators_are_dropped_when_requests_finish():
    sampler = Sampler("cpu")
    seeded = SamplingParams(temperature=1.0, seed=7)
    sampler.sample(LOGITS, [seeded, seeded], ["a", "b"])
    assert len(sampler) == 2
    sampler.drop(["a", "zzz"])
    assert len(sampler) == 1
    first = sampler.sample(LOGITS[:1], [seeded], ["a"])  # restarts from the seed
    sampler.drop(["a"])
    assert sampler.sample(LOGITS[:1], [seeded], ["a"]) == first


def test_sampling_follows_the_distribution():
    sampler = Sampler("cpu", seed=0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = [SamplingParams(temperature=1.0)]
    counts = torch.bincount(
        torch.tensor([sampler.sample(logits, params, ["r"])[0] for _ in range(2000)]), minlength=3
    )
    freq = counts.float() / 2000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


@pytest.mark.parametrize("top_k", [1, 0])
def test_top_k_one_or_tiny_top_p_equals_greedy(top_k):
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=1.0 if top_k else 0.01, seed=3)
    assert Sampler("cpu").sample(LOGITS, [params, params], ["a", "b"]) == [1, 3]
