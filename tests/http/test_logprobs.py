"""Logprobs, echo, n > 1 and the sampling parameters through the official `openai` client, checked
against transformers' log_softmax of the served checkpoint (float32, within 1e-4)."""

from __future__ import annotations

import openai
import pytest
from sloserve.testing.server_process import describe, quiescent
from sloserve.tokenizer import Tokenizer

from tests.checkpoints import hf_log_softmax
from tests.http.conftest import TOKEN

pytestmark = pytest.mark.timeout(120)
META = [("authorization", f"Bearer {TOKEN}")]
TOL = 1e-4
PROMPT = [256] + [(i * 37) % 250 for i in range(40)]


def test_chat_logprobs_equal_transformers_streamed_and_not(client, model, tiny_llama):
    kw = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    reply = client.chat.completions.create(**kw)
    ids = reply.choices[0].model_extra["token_ids"]
    prompt = Tokenizer.from_pretrained(tiny_llama).encode(
        "<|user|>hi\n<|assistant|>", add_special_tokens=False
    )
    ref = hf_log_softmax(tiny_llama, tuple(prompt + ids))
    content = reply.choices[0].logprobs.content
    assert len(content) == len(ids) == 6
    for i, (token, entry) in enumerate(zip(ids, content, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry.logprob - row[token].item()) < TOL
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row.topk(3).values.tolist(), abs=TOL
        )
        assert entry.bytes == list(entry.token.encode())
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_echo_equal_transformers(client, model, tiny_llama):
    reply = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = reply.choices[0].model_extra["token_ids"]
    ref = hf_log_softmax(tiny_llama, tuple(PROMPT + ids))
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    for i, token in enumerate(ids):
        assert abs(lp.token_logprobs[i] - ref[len(PROMPT) - 1 + i, token].item()) < TOL
        assert 1 <= len(lp.top_logprobs[i]) <= 3 and lp.tokens[i] in lp.top_logprobs[i]
    # echo (what evaluation harnesses score loglikelihood with): the prompt's logprobs lead
    echo = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = echo.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, PROMPT[p]].item()) < TOL
    assert abs(lp.token_logprobs[-1] - ref[len(PROMPT) - 1, ids[0]].item()) < TOL
    assert lp.text_offset == sorted(lp.text_offset)
    text = client.completions.create(
        model=model, prompt="echo me", max_tokens=2, temperature=0, echo=True
    )
    assert text.choices[0].text.startswith("echo me") and text.choices[0].logprobs is None


def test_n_choices_share_the_prompt_blocks_and_differ(client, model, http_server):
    before = http_server.info(metadata=META).stats
    prompt = PROMPT + [(i * 13) % 250 for i in range(60)]
    reply = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    after = http_server.info(metadata=META).stats
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({tuple(c.model_extra["token_ids"]) for c in reply.choices}) > 1  # seeds 7, 8, 9
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 15
    # choices 1 and 2 took the prompt's full blocks from the prefix cache rather than computing them
    hits = after.prefix_hit_tokens_total - before.prefix_hit_tokens_total
    assert hits >= 2 * (len(prompt) - 32), (hits, describe(after))
    again = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.model_extra["token_ids"] for c in again.choices] == [
        c.model_extra["token_ids"] for c in reply.choices
    ]
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "two"}],
            max_tokens=3,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    finished = sorted(
        c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason
    )
    assert finished == [0, 1] and chunks[-1].usage.completion_tokens == 6
    assert quiescent(http_server.wait_quiescent(30, metadata=META))


def test_sampling_parameters_are_honoured(client, model):
    forced = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=4,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].model_extra["token_ids"] == [65] * 4
    reply = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=6,
        temperature=0.8,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 6},
    )
    assert reply.usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"n": 17}, "n"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"min_tokens": 99}, "min_tokens"),
        ("completions", {"logit_bias": {"nope": 1}}, "logit_bias"),
        ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_values_are_400_and_leave_nothing_allocated(
    client, model, http_server, path, body, field
):
    with pytest.raises(openai.BadRequestError) as err:
        if path == "chat":
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=4,
                extra_body=body,
            )
        else:
            client.completions.create(model=model, prompt="x", max_tokens=4, extra_body=body)
    assert field in err.value.message
    stats = http_server.info(metadata=META).stats
    assert quiescent(stats), describe(stats)
