"""The offline API: ``LLM(model, **options).generate(prompts, params)``, batched through one engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from sloserve.config import (
    CacheConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SloserveConfig,
    parse_size,
)
from sloserve.engine.core import EngineCore
from sloserve.engine.runner import Runner
from sloserve.logprobs import Logprob
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.score import ScoreOutput, check_candidates, score_of, score_params
from sloserve.structured import check_grammar

if TYPE_CHECKING:
    from sloserve.tokenizer import Tokenizer

_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
    "parallel": ParallelConfig,
    "lora": LoraConfig,
}


@dataclass(slots=True)
class CompletionOutput:
    """One prompt's result: generated token ids only, their text, and why generation ended."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[Logprob] | None = None  # one per token id, when SamplingParams.logprobs asked
    # one per prompt token, when prompt_logprobs asked
    prompt_logprobs: list[Logprob | None] | None = None


def build_config(model: str = "default", **options: Any) -> SloserveConfig:
    """A SloserveConfig from flat options named after its fields (e.g. max_batch=8, prefix_cache=False)."""
    known = {f.name: section for section, cls in _SECTIONS.items() for f in fields(cls)}
    kwargs: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    kwargs["model"]["path"] = model
    # Offline batches queue everything at once: no queue timeout or SLO refusals unless asked.
    kwargs["scheduler"]["admission_control"] = False
    for key, value in options.items():
        if key not in known or key == "path":
            raise ValueError(
                f"unknown LLM option {key!r}; valid options: {', '.join(sorted(set(known) - {'path'}))}"
            )
        if key.endswith("_bytes") and isinstance(value, str):
            value = parse_size(value)
        kwargs[known[key]][key] = value
    return SloserveConfig(**{section: _SECTIONS[section](**kw) for section, kw in kwargs.items()})


class LLM:
    """Offline generation: every prompt of a generate() call runs batched through one EngineCore.

    The core is stepped right here, in the caller's thread: no engine thread, no event loop.
    """

    def __init__(
        self,
        model: str = "default",
        *,
        runner: Runner | None = None,
        config: SloserveConfig | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ValueError("pass either config= or individual options, not both")
        self.config = config or build_config(model, **options)
        self._core = EngineCore(self.config, runner)
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        return self._core

    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: int | list[int] = 0,
        predictions: list[str | list[int] | None] | None = None,
        adapter: str | None | list[str | None] = None,
    ) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order; a prompt is a string or a list of token ids.

        `priority` (one for all, or one per prompt): lower runs first under policy='priority'.
        `predictions` (one per prompt, None for none): the output each is expected to give, as
        text or token ids, verified as drafts (OpenAI's Predicted Outputs).
        `adapter` (one for all, or one per prompt): a loaded LoRA adapter's name, None for the
        base model; it overrides the adapter of `params`.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        if isinstance(priority, list):
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
            priorities = priority
        else:
            priorities = [priority] * len(prompts)
        if isinstance(adapter, list):
            if len(adapter) != len(prompts):
                raise ValueError(f"got {len(adapter)} adapters for {len(prompts)} prompts")
            per_prompt = [replace(p, adapter=a) for p, a in zip(per_prompt, adapter, strict=True)]
        elif adapter is not None:
            per_prompt = [replace(p, adapter=adapter) for p in per_prompt]
        for name in {p.adapter for p in per_prompt}:
            self._core.adapters.check(name)  # an unknown one raises here, before anything runs
        for grammar in {p.grammar for p in per_prompt if p.grammar is not None}:
            check_grammar(grammar)  # a bad one raises here, before anything runs
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if predictions is None:
            predictions = [None] * len(prompts)
        elif len(predictions) != len(prompts):
            raise ValueError(f"got {len(predictions)} predictions for {len(prompts)} prompts")
        drafts = [
            self.tokenizer.encode(d, add_special_tokens=False) if isinstance(d, str) else d
            for d in predictions
        ]
        news = [
            NewRequest(f"llm-{next(self._ids)}", t, p, priority=q, prediction=d)
            for t, p, q, d in zip(ids, per_prompt, priorities, drafts, strict=True)
        ]  # a malformed one raises here, before anything runs
        return self._run(news)

    def score(
        self,
        prompt: str | list[int],
        candidates: list[str] | list[list[int]],
        *,
        top_logprobs: int = 0,
    ) -> list[ScoreOutput]:
        """One ScoreOutput per candidate continuation of `prompt`, in order; the prompt is computed
        once and its cached blocks shared by every candidate (sloserve.score)."""
        tok = self.tokenizer
        prompt_ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # NOTE: a text candidate is tokenized alone, without special tokens, so its tokens are
        # the same after any prompt (a BPE merge across the boundary would change them)
        ids = [
            tok.encode(c, add_special_tokens=False) if isinstance(c, str) else list(c)
            for c in candidates
        ]
        check_candidates(
            prompt_ids,
            ids,
            self._core.scheduler.max_model_len,
            self.config.server.max_score_candidates,
        )
        params = score_params(len(prompt_ids), top_logprobs)
        news = [NewRequest(f"llm-{next(self._ids)}", prompt_ids + c, params) for c in ids]
        return [
            score_of(c, out.prompt_logprobs, top_logprobs, out.num_cached_tokens, out.error)
            for c, out in zip(ids, self._run(news), strict=True)
        ]

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder `path` as `name` (any path: the caller is the operator)."""
        self._core.adapters.load(name, path, trusted=True)

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`."""
        self._core.adapters.unload(name)

    def _run(self, news: list[NewRequest]) -> list[CompletionOutput]:
        """Feed the requests (never more than the queue cap at once) and step until all finish."""
        core, cap = self._core, self.config.scheduler.max_waiting
        index = {new.request_id: i for i, new in enumerate(news)}
        results = [CompletionOutput([], "", None, new.token_ids) for new in news]
        texts: list[list[str]] = [[] for _ in news]
        pending = iter(news)
        live = 0
        while True:
            while live < cap and (new := next(pending, None)) is not None:
                core.add(new)
                live += 1
            if not live:
                break
            for out in core.step():
                i = index[out.request_id]
                results[i].token_ids += out.new_token_ids
                if out.new_logprobs is not None:
                    results[i].logprobs = (results[i].logprobs or []) + out.new_logprobs
                if out.prompt_logprobs is not None:
                    results[i].prompt_logprobs = out.prompt_logprobs
                texts[i].append(out.new_text)
                if out.finished:
                    live -= 1
                    result = results[i]
                    result.finish_reason, result.error = out.finish_reason, out.error
                    result.num_cached_tokens = out.num_cached_tokens
        for result, text in zip(results, texts, strict=True):
            result.text = "".join(text)
        return results

    def close(self) -> None:
        """Abort anything left and stop tensor-parallel workers (there is no thread or loop to stop)."""
        self._core.abort_all()
        self._core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
