"""Sampled requests verify drafts by rejection sampling: the tokens' distribution is the one of
sampling one token at a time, shown by chi-square tests over >= 10k draws (not rejected at p=0.01)."""

from __future__ import annotations

import collections

import pytest
import torch
from sloserve import LLM
from sloserve.layers.sampler import Sampler, filtered_probs
from sloserve.sampling_params import SamplingParams

ALPHA = 0.01
DRAWS = 10_000


def _p_value(counts: list[collections.Counter]) -> float:
    """Chi-square test of homogeneity of the samples' category counts (cells expecting fewer than
    5 in any sample pooled into one)."""
    totals = [sum(c.values()) for c in counts]
    cells = set().union(*counts)
    pooled = collections.Counter()
    rows = [collections.Counter() for _ in counts]
    grand = sum(totals)
    for cell in cells:
        column = sum(c[cell] for c in counts)
        key = cell if min(column * t / grand for t in totals) >= 5 else "pooled"
        pooled[key] += column
        for row, c in zip(rows, counts, strict=True):
            row[key] += c[cell]
    stat = 0.0
    for row, total in zip(rows, totals, strict=True):
        for key, column in pooled.items():
            expected = column * total / grand
            stat += (row[key] - expected) ** 2 / expected
    dof = (len(pooled) - 1) * (len(counts) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_each_verified_token_follows_the_target_distribution():
    """Against the exact distribution: the first token follows p0 whatever the draft; after an
    accepted first draft, the second follows p1; the bonus is taken only when both are kept."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, seed=11)
    probs = filtered_probs(logits, [params, params])
    sampler = Sampler("cpu")
    # an unlikely draft (the least likely token top-k keeps), then a likely one
    drafts = [int(probs[0].masked_fill(probs[0] == 0, 2.0).argmin()), int(probs[1].argmax())]
    first, second = collections.Counter(), collections.Counter()
    for _ in range(DRAWS):
        run = sampler.verify(logits, params, "r", drafts, bonus=-1)
        first[run[0]] += 1
        if run[0] == drafts[0]:
            second[run[1]] += 1
        assert len(run) == 3 or run[-1] != -1
    for seen, p in ((first, probs[0]), (second, probs[1])):
        n = sum(seen.values())
        exact = collections.Counter(
            {t: round(float(p[t]) * n * 1000) for t in range(5) if p[t] > 0}
        )
        assert set(seen) <= set(exact)  # top-k's filtered token never comes
        assert _p_value([seen, exact]) > ALPHA


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return str(make_checkpoint("llama"))


def test_sampled_output_with_drafts_has_the_distribution_of_sampling_without(checkpoint):
    """10k sampled 3-token answers with a prediction verified (drafts for tokens 2 and 3) against
    10k without, every request seeded apart: the 3-token sequences' counts are homogeneous."""
    prompt = [11, 12, 13, 11, 12]
    options = dict(device="cpu", max_model_len=64, block_size=4, max_batch=64)

    def answers(first_seed: int, predictions=None) -> tuple[collections.Counter, int]:
        params = [
            SamplingParams(
                max_tokens=3, temperature=1.0, top_k=3, seed=first_seed + i, ignore_eos=True
            )
            for i in range(DRAWS)
        ]
        with LLM(checkpoint, num_speculative_tokens=2, **options) as llm:
            out = llm.generate([prompt] * DRAWS, params, predictions=predictions)
            accepted = llm._core.scheduler.counters.spec_accepted_tokens_total
        return collections.Counter(tuple(o.token_ids) for o in out), accepted

    with LLM(checkpoint, **options) as llm:
        greedy = llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    plain, _ = answers(0)
    drafted, accepted = answers(DRAWS, [greedy] * DRAWS)
    assert accepted > DRAWS // 10, "too few drafts accepted: the test would show little"
    assert _p_value([plain, drafted]) > ALPHA
