"""What evaluation harnesses send, through the official `openai` client: lm-eval's loglikelihood
request (context + continuation as the prompt, echo, logprobs 1, max_tokens 0), batched as lists of
prompts, scored against transformers' log_softmax of the served checkpoint (float32, within 1e-4)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sloserve.testing.server_process import describe, quiescent
from sloserve.tokenizer import Tokenizer

from tests.checkpoints import hf_log_softmax
from tests.http.conftest import TOKEN

pytestmark = pytest.mark.timeout(120)
META = [("authorization", f"Bearer {TOKEN}")]
TOL = 1e-4
CONTEXTS = [
    [256] + [(i * 37) % 250 for i in range(30)],
    [256, 72, 101, 108, 108, 111, 32],
    [256] + list(range(48, 60)),
]
CONTINUATIONS = [[(i * 11) % 250 for i in range(5)], [119, 111, 114, 108, 100], [61]]


def _check_prompt_logprobs(folder, prompt: list[int], lp) -> None:
    """Every prompt token's logprob equals transformers' (the first has none), top_logprobs holds it."""
    ref = hf_log_softmax(folder, tuple(prompt))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, prompt[p]].item()) < TOL, p
        assert lp.tokens[p] in lp.top_logprobs[p] and 1 <= len(lp.top_logprobs[p]) <= 2


def test_a_loglikelihood_request_like_lm_evals_scores_the_prompt_and_generates_nothing(
    client, model, tiny_llama, http_server
):
    before = http_server.info(metadata=META).stats
    prompt = CONTEXTS[0] + CONTINUATIONS[0]
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0.0, seed=1234
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    assert choice.text == Tokenizer.from_pretrained(tiny_llama).decode(prompt)
    _check_prompt_logprobs(tiny_llama, prompt, choice.logprobs)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 0
    # lm-eval sums the continuation's logprobs and checks each is the greedy pick
    ref = hf_log_softmax(tiny_llama, tuple(prompt))
    want = sum(ref[p - 1, prompt[p]].item() for p in range(len(CONTEXTS[0]), len(prompt)))
    assert sum(choice.logprobs.token_logprobs[len(CONTEXTS[0]) :]) == pytest.approx(
        want, abs=5 * TOL
    )
    after = http_server.info(metadata=META).stats
    assert after.generated_tokens_total == before.generated_tokens_total  # nothing was sampled
    assert quiescent(http_server.wait_quiescent(30, metadata=META))
    # streamed: one chunk with the prompt and its logprobs, then the finish
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=0,
            echo=True,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(texts) == 1 and texts[0].text == choice.text
    streamed = texts[0].logprobs.token_logprobs
    assert streamed[0] is None and streamed[1:] == pytest.approx(
        choice.logprobs.token_logprobs[1:], abs=1e-6
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(prompt)
    # without logprobs, echo with max_tokens 0 is the prompt alone
    bare = client.completions.create(model=model, prompt="score me", max_tokens=0, echo=True)
    assert bare.choices[0].text == "score me" and bare.choices[0].logprobs is None
    assert bare.choices[0].finish_reason == "length"


def test_a_batch_of_loglikelihood_requests_gives_one_choice_per_prompt(
    client, model, tiny_llama, http_server
):
    prompts = [c + k for c, k in zip(CONTEXTS, CONTINUATIONS, strict=True)]
    reply = client.completions.create(
        model=model, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0.0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        assert choice.finish_reason == "length"
        _check_prompt_logprobs(tiny_llama, prompt, choice.logprobs)
    assert (
        reply.usage.prompt_tokens == sum(map(len, prompts)) and reply.usage.completion_tokens == 0
    )
    assert quiescent(http_server.wait_quiescent(30, metadata=META))


def test_a_list_of_prompts_times_n_is_prompt_major_streamed_and_not(
    client, model, tiny_llama, http_server
):
    prompts = ["one two three", "four"]
    kw = {
        "model": model,
        "prompt": prompts,
        "max_tokens": 3,
        "temperature": 0.0,
        "n": 2,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    reply = client.completions.create(**kw)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(**{**kw, "prompt": p, "n": 1}).choices[0] for p in prompts]
    for i, choice in enumerate(reply.choices):  # index = prompt * n + j; greedy: both choices alike
        assert choice.model_extra["token_ids"] == singles[i // 2].model_extra["token_ids"]
        assert choice.text == singles[i // 2].text
    tokenizer = Tokenizer.from_pretrained(tiny_llama)
    # each prompt once
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    texts = ["", "", "", ""]
    finished = []
    for chunk in chunks:
        if chunk.choices:
            texts[chunk.choices[0].index] += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                finished.append(chunk.choices[0].index)
    assert texts == [c.text for c in reply.choices] and sorted(finished) == [0, 1, 2, 3]
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 12
    echoed = client.completions.create(**{**kw, "echo": True, "n": 1})
    assert [c.text[: len(p)] for c, p in zip(echoed.choices, prompts, strict=True)] == prompts
    assert quiescent(http_server.wait_quiescent(30, metadata=META))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": ["x"] * 65}, "--max-prompts-per-request"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["x", ""]}, "prompt[1]"),
        ({"prompt": [[1, 2], [3, -1]]}, "prompt[1]"),
        (
            {"prompt": ["x", "y" * 5000]},
            "prompt[1]: prompt has 5000 characters",
        ),  # over 16 per token of 256
        ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"prompt": ["x", "y"], "max_tokens": 0}, "max_tokens"),
    ],
    ids=[
        "too-many-prompts",
        "empty-list",
        "empty-prompt",
        "bad-token",
        "too-long",
        "max-tokens-0-no-echo",
        "batch-no-echo",
    ],
)
def test_bad_batches_are_400_naming_the_field_and_reach_no_engine(
    client, model, http_server, body, field
):
    before = http_server.info(metadata=META).stats
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, **{"max_tokens": 2, **body})
    assert field in err.value.message
    stats = http_server.info(metadata=META).stats
    assert quiescent(stats), describe(stats)
    # the engine never saw it
    assert stats.requests_finished_total == before.requests_finished_total


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_scored_prompt_counts_as_a_request_without_a_first_token(client, model, http_server):
    """It finishes 'length', with an end-to-end time and no TTFT observed; an SLO judges its TTFT
    by its answer (a generous one is met)."""
    before = _metrics(http_server.url)
    client.completions.create(
        model=model,
        prompt=CONTEXTS[1],
        max_tokens=0,
        echo=True,
        logprobs=1,
        extra_body={"slo": {"ttft_s": 60}},
    )
    after = _metrics(http_server.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("sloserve_requests_total", outcome="length") == 1
    assert delta("sloserve_e2e_seconds_count") == 1 and delta("sloserve_ttft_seconds_count") == 0
    assert (
        sum(
            v - before.get(k, 0.0)
            for k, v in after.items()
            if k[0] == "sloserve_slo_requests_total" and ("outcome", "met") in k[1]
        )
        == 1
    )


def test_one_bad_prompt_fails_the_batch_and_frees_the_others(client, model, http_server):
    # a token id past the vocabulary: the engine refuses it
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=model, prompt=[CONTEXTS[0], [1, 10**6]], max_tokens=0, echo=True, logprobs=1
        )
    assert "token" in err.value.message
    stats = http_server.wait_quiescent(30, metadata=META)
    assert quiescent(stats), describe(stats)
