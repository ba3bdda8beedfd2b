"""Logprobs, prompt logprobs, penalties and min_tokens through the engine, against transformers.

Logprobs are the model's raw log-softmax (before temperature, penalties and logit_bias, as vLLM's
default), so they must equal transformers' log_softmax of the same checkpoint's logits in float32
within 1e-4: for sampled tokens on every step path (chunked prefill, the fused decode kernel, runs
of decode steps), and for every prompt position (echo), whatever the prefix cache holds.
"""

from __future__ import annotations

import functools

import pytest
import torch
from sloserve import LLM
from sloserve.errors import InvalidRequestError
from sloserve.sampling_params import SamplingParams

from tests.checkpoints import load_hf_model

TOL = 1e-4
PROMPTS = [
    [256] + [(i * 37) % 250 for i in range(45)],
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 70)),
]


@functools.cache
def _hf(folder):
    return load_hf_model(folder)


def _reference(folder, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax [len(tokens), V] of the checkpoint's logits, float32."""
    with torch.no_grad():
        return _hf(folder)(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def _llm(folder, **kw) -> LLM:
    return LLM(
        str(folder), device="cpu", max_model_len=128, block_size=4, max_batched_tokens=16, **kw
    )


def _check_output_logprobs(folder, prompt, out, top):
    ref = _reference(folder, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < TOL
        assert len(entry.top) == top
        values, ids = row.topk(top)
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        for t, v in entry.top:
            assert abs(v - row[t].item()) < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("steps", [1, 4])
def test_output_logprobs_equal_transformers_log_softmax(make_checkpoint, arch, steps):
    folder = make_checkpoint(arch)
    params = [
        SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True),
        # raw, not scaled
        SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True, temperature=1.3, seed=3),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    with _llm(folder, num_scheduler_steps=steps) as llm:
        outs = llm.generate(PROMPTS, params)
    _check_output_logprobs(folder, PROMPTS[0], outs[0], 5)
    _check_output_logprobs(folder, PROMPTS[1], outs[1], 0)
    assert outs[2].logprobs is None and outs[2].prompt_logprobs is None  # not asked: nothing kept


@pytest.mark.parametrize(
    ("arch", "chunk"),
    [("llama", 16), ("llama", 128), ("qwen2_moe", 16)],
    ids=["fused-rows", "flat-path", "moe"],
)
def test_prompt_logprobs_equal_transformers_per_position_even_after_a_prefix_hit(
    make_checkpoint, arch, chunk
):
    """chunk 16: chunks of the fused kernel's rows (llama); 128: one 90-token pass on the flat path."""
    folder = make_checkpoint(arch)
    prompt = PROMPTS[0] + [(i * 11) % 250 for i in range(44)]
    ref = _reference(folder, prompt)
    with LLM(
        str(folder), device="cpu", max_model_len=128, block_size=4, max_batched_tokens=chunk
    ) as llm:
        # its blocks now sit in the prefix cache
        warm = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
        assert warm.prompt_logprobs is None
        again = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
        assert again.num_cached_tokens > 0
        out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, logprobs=1))[0]
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free == bm.num_usable  # its own copies of the cached blocks came back too
    assert out.num_cached_tokens == 0  # it skipped the cache: every prompt row's logits computed
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry.token_id == prompt[p]
        assert abs(entry.logprob - ref[p - 1, prompt[p]].item()) < TOL
        assert [t for t, _ in entry.top] == ref[p - 1].topk(3).indices.tolist()


def test_greedy_with_repetition_penalty_equals_transformers_generate(make_checkpoint):
    folder = make_checkpoint("llama")
    model = _hf(folder)
    model.generation_config.eos_token_id = None
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=8,
                repetition_penalty=1.8,
                pad_token_id=258,
            )
            want.append(out[0, len(prompt) :].tolist())
    with _llm(folder, num_scheduler_steps=4) as llm:
        got = llm.generate(
            PROMPTS, SamplingParams(max_tokens=8, repetition_penalty=1.8, ignore_eos=True)
        )
    assert [o.token_ids for o in got] == want
    with _llm(folder) as llm:  # and without it the tokens differ: the penalty did something
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in plain] != want


def test_min_tokens_holds_eos_back_until_reached(make_checkpoint):
    folder = make_checkpoint("llama")
    with _llm(folder, num_scheduler_steps=4) as llm:
        eos = llm.engine.runner.eos_token_ids[0]
        forced = {eos: 100.0}  # EOS would come first every step
        alone = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, logit_bias=forced))[0]
        held = llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=8, logit_bias=forced, min_tokens=3)
        )[0]
    assert alone.token_ids == [eos] and alone.finish_reason == "stop"
    assert len(held.token_ids) == 4 and eos not in held.token_ids[:3] and held.token_ids[3] == eos
    assert held.finish_reason == "stop"


def test_min_tokens_holds_stop_strings_back_too(make_checkpoint):
    forced = {65: 100.0}  # every token is 'A'
    with _llm(make_checkpoint("llama")) as llm:
        cut = llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=8, logit_bias=forced, stop=["A"])
        )[0]
        held = llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=8, logit_bias=forced, stop=["A"], min_tokens=5)
        )[0]
    assert cut.token_ids == [65] and cut.text == "" and cut.finish_reason == "stop"
    # the fifth token is the first checked: the text ends before its "A"
    assert held.token_ids == [65] * 5 and held.text == "AAAA" and held.finish_reason == "stop"


def test_logit_bias_outside_the_vocabulary_is_refused(make_checkpoint):
    with (
        _llm(make_checkpoint("llama")) as llm,
        pytest.raises(InvalidRequestError, match="logit_bias names token id"),
    ):
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))


def test_two_tensor_parallel_ranks_give_one_ranks_logprobs_and_penalties(tiny_llama):
    params = SamplingParams(
        max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1, repetition_penalty=1.5
    )
    results = {}
    for size in (1, 2):
        with LLM(
            str(tiny_llama), device="cpu", tensor_parallel_size=size, max_model_len=128
        ) as llm:
            results[size] = llm.generate([PROMPTS[0]], params)[0]
    one, two = results[1], results[2]
    assert two.token_ids == one.token_ids
    assert [e.logprob for e in two.logprobs] == pytest.approx(
        [e.logprob for e in one.logprobs], abs=TOL
    )
    assert [e.logprob for e in two.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in one.prompt_logprobs[1:]], abs=TOL
    )


def test_prompt_logprobs_survive_preemption(make_checkpoint):
    """Three long requests in a pool that holds one at a time: they are preempted and recomputed,
    and each prompt's logprobs still equal transformers' (kept once, never duplicated)."""
    folder = make_checkpoint("llama")
    with _llm(folder) as probe:
        page = probe.engine.runner.page_bytes
    prompts = [PROMPTS[0] + [(i * 7 + k) % 250 for k in range(40)] for i in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with _llm(folder, kv_pool_bytes=40 * page, max_batch=3) as llm:
        outs = llm.generate(prompts, params)
        assert llm.engine.scheduler.counters.preemptions_total > 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _reference(folder, prompt + out.token_ids)
        assert len(out.prompt_logprobs) == len(prompt) and len(out.logprobs) == 24
        got = [e.logprob for e in out.prompt_logprobs[1:]]
        assert got == pytest.approx(
            [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=TOL
        )
        assert [e.logprob for e in out.logprobs] == pytest.approx(
            [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)], abs=TOL
        )
