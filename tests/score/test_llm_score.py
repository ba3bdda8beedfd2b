"""LLM.score: candidate continuations after one prompt, scored on the prompt's shared blocks.

The oracle is a from-scratch forward: transformers on the same float32 checkpoint, and the
engine itself with prefix caching off (max abs diff <= 1e-4 per token).
"""

from __future__ import annotations

import random

import pytest
import torch
from sloserve import LLM
from sloserve.errors import InvalidRequestError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.score import score_params

from tests.checkpoints import load_hf_model

TOL = 1e-4
BLOCK = 4
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=512, block_size=BLOCK)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


PROMPT = [256, *_tokens(37, 0)]
CANDIDATES = [_tokens(n, i + 1) for i, n in enumerate([1, 5, 12, 3, 9])]


def _reference(folder, prompt: list[int], candidate: list[int]) -> list[float]:
    with torch.no_grad():
        logits = load_hf_model(folder)(torch.tensor([prompt + candidate])).logits[0]
    logp = logits.float().log_softmax(dim=-1)
    return [logp[len(prompt) + i - 1, t].item() for i, t in enumerate(candidate)]


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return make_checkpoint("llama")


def test_scores_equal_transformers_and_the_engine_without_prefix_reuse(folder):
    with LLM(str(folder), max_batched_tokens=16, **OPTIONS) as llm:
        got = llm.score(PROMPT, CANDIDATES, top_logprobs=3)
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free == bm.num_usable
    with LLM(str(folder), prefix_cache=False, **OPTIONS) as plain:
        cold = plain.score(PROMPT, CANDIDATES, top_logprobs=3)
    for c, out, base in zip(CANDIDATES, got, cold, strict=True):
        assert out.error is None and out.token_ids == c
        assert out.token_logprobs == pytest.approx(_reference(folder, PROMPT, c), abs=TOL)
        assert out.token_logprobs == pytest.approx(base.token_logprobs, abs=TOL)
        assert out.sum_logprob == pytest.approx(sum(out.token_logprobs), abs=1e-9)
        assert [len(top) for top in out.top_logprobs] == [3] * len(c)
        assert [[t for t, _ in top] for top in out.top_logprobs] == [
            [t for t, _ in top] for top in base.top_logprobs
        ]
        assert base.num_cached_tokens == 0
    # every candidate after the first reused the prompt's full blocks before its last row
    assert sorted(o.num_cached_tokens for o in got)[1:] == [36] * (len(CANDIDATES) - 1)


def test_k8_candidates_compute_the_prompt_once(folder):
    prompt = [256, *_tokens(199, 7)]
    candidates = [_tokens(n, 100 + n) for n in (10, 40, 25, 17, 33, 8, 30, 37)]
    with LLM(str(folder), max_batched_tokens=64, **OPTIONS) as llm:
        counters = llm.engine.scheduler.counters
        before = counters.computed_prompt_tokens_total
        outs = llm.score(prompt, candidates)
        computed = counters.computed_prompt_tokens_total - before
    assert all(o.error is None for o in outs)
    needed = len(prompt) + sum(map(len, candidates))
    # each candidate recomputes at most the prompt's partial last block: <= K blocks over the need
    assert computed <= needed + len(candidates) * BLOCK
    assert computed <= 1.1 * needed


def test_candidates_beside_an_in_flight_generation_of_the_prompt(folder):
    """A generation of the same prompt is mid-prefill when the candidates arrive: they share its
    blocks, its tokens are those it gets alone, and the scores are the same as without it."""
    gen = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(folder), max_batched_tokens=8, **OPTIONS) as llm:
        alone = llm.generate([PROMPT + [1]], gen)[0].token_ids
        expected = llm.score(PROMPT + [1], CANDIDATES)
    with LLM(str(folder), max_batched_tokens=8, **OPTIONS) as llm:
        core = llm.engine
        core.add(NewRequest("gen", PROMPT + [1], gen))
        core.step()
        params = score_params(len(PROMPT) + 1)
        for i, c in enumerate(CANDIDATES):
            core.add(NewRequest(f"c{i}", PROMPT + [1] + c, params))
        made, scored = [], {}
        while core.has_work():
            for out in core.step():
                if out.request_id == "gen":
                    made += out.new_token_ids
                elif out.finished:
                    scored[out.request_id] = out
        bm = core.scheduler.block_manager
        assert bm.num_free == bm.num_usable
    assert made == alone
    for i, (c, want) in enumerate(zip(CANDIDATES, expected, strict=True)):
        out = scored[f"c{i}"]
        assert out.error is None and out.num_cached_tokens == 36
        got = [e.logprob for e in out.prompt_logprobs[-len(c) :]]
        assert got == pytest.approx(want.token_logprobs, abs=TOL)
        assert all(e is None for e in out.prompt_logprobs[: len(PROMPT) + 1])


@pytest.mark.parametrize(
    ("prompt", "candidates", "match"),
    [
        ([], [[1]], "prompt is empty"),
        (PROMPT, [], "candidates is empty"),
        (PROMPT, [[1], []], r"candidates\[1\] is empty"),
        (PROMPT, [[1]] * 3, "candidates has 3 entries but at most 2.*--max-score-candidates"),
        (PROMPT, [[1], [2] * 480], r"candidates\[1\]: prompt \+ candidate is 518 tokens"),
    ],
)
def test_bad_input_names_the_field(folder, prompt, candidates, match):
    with LLM(str(folder), max_score_candidates=2, **OPTIONS) as llm:
        with pytest.raises(InvalidRequestError, match=match):
            llm.score(prompt, candidates)
        assert not llm.engine.scheduler.requests


def test_a_negative_top_logprobs_is_named(folder):
    with LLM(str(folder), **OPTIONS) as llm:
        with pytest.raises(InvalidRequestError, match="top_logprobs must be an integer >= 0"):
            llm.score(PROMPT, [[1]], top_logprobs=-1)


def test_text_candidates_are_tokenized_alone(folder):
    with LLM(str(folder), **OPTIONS) as llm:
        ids = llm.tokenizer.encode("ab", add_special_tokens=False)
        (by_text,) = llm.score("hello", ["ab"])
        (by_ids,) = llm.score(llm.tokenizer.encode("hello"), [ids])
    assert by_text.token_ids == ids
    assert by_text.token_logprobs == pytest.approx(by_ids.token_logprobs, abs=TOL)
