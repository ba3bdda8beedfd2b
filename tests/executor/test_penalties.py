"""Logits processing before sampling equals transformers' processors (or OpenAI's formula), row by row."""

from __future__ import annotations

import pytest
import torch
from sloserve.layers.logprobs import gather_logprobs
from sloserve.layers.penalties import process_logits
from sloserve.layers.sampler import filtered_probs
from sloserve.sampling_params import SamplingParams
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

VOCAB = 50
EOS = 7


def _logits(rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = _logits()
    contexts = [[1, 2, 3, 3, 40], [5, 6], [9, 9, 9, 11, 12, 13]]
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    got = process_logits(logits, params, contexts, [2, 0, 3], [EOS])
    for i, context in enumerate(contexts):
        want = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([context]), logits[i : i + 1].clone()
        )
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=0)


def test_presence_and_frequency_follow_openais_formula():
    logits = _logits(1)
    context = [3, 4, 4, 4, 8, 8, 20]  # prompt [3, 4], output [4, 4, 8, 8, 20]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4)
    got = process_logits(logits, [params], [context], [5], [EOS])[0]
    want = logits[0].clone()
    for token, count in {
        4: 2,
        8: 2,
        20: 1,
    }.items():  # output counts only: the prompt's 3 and first 4 are free
        want[token] -= count * -0.4 + 0.7
    torch.testing.assert_close(got, want)


def test_logit_bias_and_min_tokens_mask_eos_and_stop_ids_until_reached():
    logits = _logits(3)
    early = SamplingParams(
        max_tokens=8, min_tokens=2, stop_token_ids=[11], logit_bias={5: 100.0, 6: -3.5}
    )
    ignore = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
    got = process_logits(logits, [early, early, ignore], [None] * 3, [1, 2, 0], [EOS])
    assert got[0, EOS] == float("-inf") and got[0, 11] == float("-inf")
    assert got[0, 5] == pytest.approx(logits[0, 5] + 100.0) and got[0, 6] == pytest.approx(
        logits[0, 6] - 3.5
    )
    # min_tokens reached: nothing masked
    assert got[1, EOS] == logits[1, EOS] and got[1, 11] == logits[1, 11]
    assert got[2, EOS] == logits[2, EOS]  # ignore_eos: EOS is not masked
    untouched = process_logits(logits, [SamplingParams()] * 3, [None] * 3, [0] * 3, [EOS])
    assert torch.equal(untouched, logits) and untouched.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize(("min_p", "temperature"), [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_keeps_the_tokens_transformers_keeps(min_p, temperature):
    logits = _logits(2)
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 2
    got = filtered_probs(logits, params)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    want = MinPLogitsWarper(min_p)(None, scores).softmax(dim=-1)
    torch.testing.assert_close(got, want)


def test_logprobs_are_log_softmax_with_the_top_entries():
    logits = _logits(2)
    entries = gather_logprobs(logits, [4, 9], [3, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert entries[0].token_id == 4 and entries[0].logprob == pytest.approx(
        ref[0, 4].item(), abs=1e-6
    )
    values, ids = ref[0].topk(3)
    assert [t for t, _ in entries[0].top] == ids.tolist()
    assert [v for _, v in entries[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert entries[1].top == [] and entries[1].logprob == pytest.approx(ref[1, 9].item(), abs=1e-6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_tokens", 9),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("logprobs", -1),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=8, **{field: value})
