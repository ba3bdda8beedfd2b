"""The offline API: ``LLM(model, **options).generate(prompts, params)``, batched through one engine."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, fields
from typing import Any

from sloserve.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SloserveConfig,
    parse_size,
)
from sloserve.engine import AsyncEngine
from sloserve.sampling_params import SamplingParams

_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "server": ServerConfig}


@dataclass(slots=True)
class CompletionOutput:
    """One prompt's result: generated token ids only, their text, and why generation ended."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    error: str | None = None


def build_config(model: str = "default", **options: Any) -> SloserveConfig:
    """A SloserveConfig from flat options named after its fields (e.g. max_batch=8, prefix_cache=False)."""
    known = {f.name: section for section, cls in _SECTIONS.items() for f in fields(cls)}
    kwargs: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    kwargs["model"]["path"] = model
    # Offline batches queue everything at once: no queue timeout or SLO refusals unless asked.
    kwargs["scheduler"]["admission_control"] = False
    for key, value in options.items():
        if key not in known or key == "path":
            raise ValueError(f"unknown LLM option {key!r}; valid options: {', '.join(sorted(set(known) - {'path'}))}")
        if key.endswith("_bytes") and isinstance(value, str):
            value = parse_size(value)
        kwargs[known[key]][key] = value
    return SloserveConfig(**{section: _SECTIONS[section](**kw) for section, kw in kwargs.items()})


class LLM:
    """Offline generation: every prompt of a generate() call runs batched through the same engine."""

    def __init__(self, model: str = "default", *, runner: Any = None, config: SloserveConfig | None = None,
                 **options: Any) -> None:
        if config is not None and options:
            raise ValueError("pass either config= or individual options, not both")
        self.config = config or build_config(model, **options)
        self._loop = asyncio.new_event_loop()
        self._engine = AsyncEngine(self.config, runner)
        self._ids = itertools.count()
        self._loop.run_until_complete(self._engine.start())

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order; a prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        return self._loop.run_until_complete(self._generate_all(prompts, per_prompt))

    async def _generate_all(self, prompts: list, params: list[SamplingParams]) -> list[CompletionOutput]:
        slots = asyncio.Semaphore(self.config.scheduler.max_waiting)  # never overflow the queue cap

        async def one(prompt: str | list[int], p: SamplingParams) -> CompletionOutput:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            async with slots:
                stream = self._engine.add_request(f"llm-{next(self._ids)}", ids, p)
                tokens: list[int] = []
                text: list[str] = []
                last = None
                async for out in stream:
                    tokens += out.new_token_ids
                    text.append(out.new_text)
                    last = out
            return CompletionOutput(token_ids=tokens, text="".join(text), finish_reason=last.finish_reason,
                                    prompt_token_ids=ids, num_cached_tokens=last.num_cached_tokens,
                                    error=last.error)

        return list(await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params, strict=True))))

    def close(self) -> None:
        """Stop the engine thread and release the event loop."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._engine.stop())
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
