"""The official `openai` client against a real `sloserve serve`: completions and chat, streamed and not,
models, usage, stop strings, seeds -- and greedy tokens equal to gRPC's and the offline LLM's."""

from __future__ import annotations

import openai
import pytest
from sloserve.config import CacheConfig, ModelConfig, SloserveConfig
from sloserve.llm import LLM
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.sampling_params import SamplingParams
from sloserve.tokenizer import Tokenizer

from tests.http.conftest import TEMPLATE, TOKEN
from tests.reliability.client import generate

pytestmark = pytest.mark.timeout(120)


def test_models_list_names_the_served_model(client, tiny_llama):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_llama)]
    assert models[0].object == "model" and models[0].owned_by == "sloserve"


def test_completion_not_streamed_counts_usage(client, model):
    reply = client.completions.create(
        model=model, prompt="hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == 6  # <s> + five bytes (the byte-level tokenizer)
    assert reply.usage.completion_tokens == 8 and reply.usage.total_tokens == 14


def test_completion_streamed_equals_not_streamed_and_ends_with_usage(client, model):
    kw = {
        "model": model,
        "prompt": "stream me",
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_renders_the_template_streamed_and_not(client, model, tiny_llama):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    kw = {
        "model": model,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    reply = client.chat.completions.create(**kw)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == reply.choices[0].message.content
    )
    # the same tokens as a completion of the rendered template (no second <s>: the template owns it)
    rendered = "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert TEMPLATE  # the template of conftest renders exactly that
    ids = Tokenizer.from_pretrained(tiny_llama).encode(rendered, add_special_tokens=False)
    plain = client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert reply.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert reply.usage.prompt_tokens == len(ids)


def test_stop_strings_end_the_text_before_them(client, model):
    kw = {
        "model": model,
        "prompt": "count",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    text = client.completions.create(**kw).choices[0].text
    stop = next((ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd"), None)
    if stop is None:
        pytest.skip(f"the tiny model's output {text!r} has no printable character to stop on")
    reply = client.completions.create(**kw, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == text[: text.index(stop)]


def test_a_seed_makes_sampling_reproducible(client, model):
    kw = {
        "model": model,
        "prompt": "dice",
        "max_tokens": 16,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    first = client.completions.create(**kw, seed=7).choices[0].text
    assert client.completions.create(**kw, seed=7).choices[0].text == first
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (8, 9)}
    assert others != {first}


def test_client_errors_carry_status_and_field(client, model, http_server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", n=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n"
    with openai.OpenAI(base_url=f"{http_server.url}/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=model, prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_greedy_tokens_over_http_equal_grpc_and_the_offline_llm(
    client, model, http_server, tiny_llama
):
    prompts = [[1, *range(10 + 7 * i, 40 + 5 * i)] for i in range(3)]
    over_http = []
    for ids in prompts:
        reply = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        over_http.append(reply.choices[0].model_extra["token_ids"])
    over_grpc = []
    with http_server.sync_channel() as channel:
        stub = pb_grpc.SloserveStub(channel)
        for i, ids in enumerate(prompts):
            request = generate(f"eq{i}", ids=ids, max_tokens=16).generate
            over_grpc.append(
                [
                    t
                    for m in stub.Generate(
                        request, timeout=60, metadata=[("authorization", f"Bearer {TOKEN}")]
                    )
                    if m.WhichOneof("kind") == "chunk"
                    for t in m.chunk.token_ids
                ]
            )
    config = SloserveConfig(
        model=ModelConfig(path=str(tiny_llama), device="cpu", max_model_len=256),
        cache=CacheConfig(kv_pool_bytes=256 * 8192),
    )
    with LLM(config=config) as llm:
        offline = [
            o.token_ids
            for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        ]
    assert over_http == over_grpc == offline
