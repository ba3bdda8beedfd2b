"""OpenAI request JSON -> the front end's ParsedRequest; every known field checked, unknown ones ignored.

A field with a bad value raises HttpError 400 naming the field and what to change. Structured
output and tools are read by http/structured.py and http/tools.py. Fields this server cannot
honour (best_of, suffix) are 400 too, saying so, rather than silently ignored; their neutral
values are accepted (routers send them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sloserve.errors import InvalidRequestError
from sloserve.frontend import ParsedRequest
from sloserve.http.errors import HttpError
from sloserve.http.structured import structured_grammar
from sloserve.http.tools import ToolRequest, parse_tools
from sloserve.sampling_params import SLO, SamplingParams

_MISSING = object()

# known OpenAI / vLLM fields this server cannot honour: accepted only with their neutral value
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not implemented; send separate requests"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not implemented"),
}


@dataclass(slots=True)
class CompletionRequest:
    """One /v1/completions or /v1/chat/completions request as the edge runs it."""

    parsed: ParsedRequest
    model: str
    stream: bool
    include_usage: bool
    # vLLM's extension: each choice (and chunk) carries its token ids
    return_token_ids: bool = False
    echo: bool = False  # completions: the prompt leads the text (and its logprobs, with logprobs)
    # each choice carries its tokens' logprobs (SamplingParams.logprobs top entries)
    logprobs: bool = False
    # chat with tools: rendered by the template, calls parsed from the answer
    tools: ToolRequest | None = None
    # completions' list of prompts (parsed has the first); None: one
    prompts: list[str | list[int]] | None = None

    def for_prompt(self, index: int) -> ParsedRequest:
        """The request of prompt `index` of a list of prompts (all share every other field)."""
        return (
            self.parsed
            if self.prompts is None
            else dataclasses.replace(self.parsed, prompt=self.prompts[index])
        )


def parse_completion(
    body: Any, *, model: str, default_max_tokens: int, slo: SLO | None
) -> CompletionRequest:
    """A /v1/completions body: `prompt` is a string, token ids, or a list of either (one choice per
    prompt). max_tokens 0 with echo scores the prompt only (its logprobs; nothing is generated)."""
    body = _object(body)
    prompts = _prompts(body.get("prompt", _MISSING))
    if body.get("tools"):
        raise _bad("tools", "are for /v1/chat/completions, whose chat template renders them")
    logprobs = _int(body, "logprobs", None, minimum=0)
    echo = _bool(body, "echo", False)
    prompt_logprobs = logprobs if echo else None
    zero = _asks_no_tokens(body)
    if zero and not echo:
        raise _bad(
            zero,
            "must be >= 1, got 0 (0 only with echo: true, which returns the prompt and, with "
            "logprobs, its logprobs)",
        )
    if zero:
        # the engine scores the prompt; without logprobs none is shown
        prompt_logprobs = logprobs or 0
    request = _request(
        body,
        prompts[0],
        model=model,
        default_max_tokens=default_max_tokens,
        slo=slo,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        min_max_tokens=0 if zero else 1,
    )
    request.echo = echo
    request.prompts = prompts if len(prompts) > 1 else None
    return request


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, token ids, or a non-empty list of either."""
    if prompt is _MISSING or prompt is None:
        raise _bad("prompt", "is required: a string, a list of token ids, or a list of either")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise _bad(
            "prompt",
            f"must be a string, a list of token ids, or a list of either, got {_kind(prompt)}",
        )
    if not prompt:
        raise _bad(
            "prompt", "is an empty list: send a string, token ids, or a non-empty list of either"
        )
    if not all(isinstance(p, str | list) for p in prompt):
        return [_token_ids("prompt", prompt)]
    for i, p in enumerate(prompt):
        if isinstance(p, list):
            _token_ids(f"prompt[{i}]", p)
        if not p:
            raise _bad(f"prompt[{i}]", "is empty: send some text or token ids")
    return prompt


def _asks_no_tokens(body: dict) -> str | None:
    """The field that asks for 0 tokens (max_completion_tokens wins over max_tokens), else None."""
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    return name if _int(body, name, None) == 0 else None


def _token_ids(field: str, ids: list) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise _bad(field, "must be a string or a list of non-negative integer token ids")
    return ids


def parse_chat(
    body: Any, render: Callable[..., str], *, model: str, default_max_tokens: int, slo: SLO | None
) -> CompletionRequest:
    """A /v1/chat/completions body: `messages` (and `tools`) rendered to one prompt by `render` (the chat
    template), with add_generation_prompt, continue_final_message and chat_template_kwargs passed through."""
    body = _object(body)
    top_logprobs = _int(body, "top_logprobs", None, minimum=0)
    if top_logprobs and not _bool(body, "logprobs", False):
        raise _bad("top_logprobs", "needs logprobs: true")
    tools = parse_tools(body)
    prompt = render_messages(body, render, tools.tools if tools else None)
    logprobs = (top_logprobs or 0) if _bool(body, "logprobs", False) else None
    request = _request(
        body,
        prompt,
        model=model,
        default_max_tokens=default_max_tokens,
        slo=slo,
        logprobs=logprobs,
        grammar=tools.grammar if tools else None,
    )
    # the template wrote them
    request.parsed.add_special_tokens = _bool(body, "add_special_tokens", False)
    request.tools = tools if tools and tools.parses else None
    return request


def render_messages(body: dict, render: Callable[..., str], tools: list[dict] | None = None) -> str:
    """The chat fields of `body` (messages, add_generation_prompt, ...) and `tools` rendered to the prompt text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required: a non-empty list of {role, content} objects")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    continue_final = _bool(body, "continue_final_message", False)
    options = {
        "add_generation_prompt": _bool(body, "add_generation_prompt", not continue_final),
        "continue_final_message": continue_final,
    }
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad(
                "chat_template_kwargs",
                f'must be an object such as {{"enable_thinking": false}}, got {_kind(kwargs)}',
            )
        options["template_kwargs"] = kwargs
    if tools:
        options["tools"] = tools
    try:
        return render(clean, **options)
    except InvalidRequestError as exc:
        message = str(exc)
        param = (
            message.split(" ", 1)[0]
            if message.startswith(("continue_final", "chat_template"))
            else "messages"
        )
        raise HttpError(400, message, param=param) from None


def _message(index: int, message: Any) -> dict:
    """One message as a template sees it: role, text content, and every other field kept (tool_calls,
    tool_call_id, name, reasoning_content, ...), tool call arguments given as JSON text parsed."""
    field = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(field, f"must be an object with role and content, got {_kind(message)}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(
            f"{field}.role", "must be a non-empty string such as 'system', 'user' or 'assistant'"
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text can be rendered
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(
                    f"{field}.content[{j}]",
                    'must be {"type": "text", "text": ...}; this server takes text only',
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise _bad(
            f"{field}.content", f"must be a string or a list of text parts, got {_kind(content)}"
        )
    out = {**message, "role": role, "content": content}
    if "tool_calls" in message and message["tool_calls"] is not None:
        out["tool_calls"] = _tool_calls(field, message["tool_calls"])
    return out


def _tool_calls(field: str, calls: Any) -> list[dict]:
    """An assistant message's tool_calls; arguments sent as JSON text become the object templates expect."""
    if not isinstance(calls, list):
        raise _bad(f"{field}.tool_calls", f"must be a list of tool calls, got {_kind(calls)}")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise _bad(f"{field}.tool_calls[{j}]", f"must be an object, got {_kind(call)}")
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = (
                    json.loads(function["arguments"]) if function["arguments"].strip() else {}
                )
            except json.JSONDecodeError as exc:
                raise _bad(
                    f"{field}.tool_calls[{j}].function.arguments",
                    f"must be JSON text (an object), got {_kind(function['arguments'])}: {exc}",
                ) from None
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def _request(
    body: dict,
    prompt: str | list[int],
    *,
    model: str,
    default_max_tokens: int,
    slo: SLO | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
    min_max_tokens: int = 1,
) -> CompletionRequest:
    for name, (neutral, why) in _NEUTRAL.items():
        if not neutral(body.get(name)):
            raise HttpError(400, f"{why}; omit {name}", param=name)
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise _bad("model", f"must be a string, got {_kind(requested)}")
    # NOTE: another name is a LoRA adapter's (vLLM's convention); the engine knows which are
    # loaded and answers an unknown one 404 model_not_found
    adapter = requested if requested and requested != model else None
    n = _int(body, "n", 1, minimum=1)
    max_tokens = _int(body, "max_completion_tokens", None, minimum=min_max_tokens)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", default_max_tokens, minimum=min_max_tokens)
    top_k = _int(body, "top_k", 0, minimum=-1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "must be a non-empty string or a list of non-empty strings")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise _bad("stop_token_ids", "must be a list of integer token ids")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad(
            "stream_options",
            f'must be an object such as {{"include_usage": true}}, got {_kind(options)}',
        )
    include_usage = _bool(
        options or {}, "include_usage", False, field="stream_options.include_usage"
    )
    structured = structured_grammar(body)
    if structured is not None and grammar is not None:
        raise _bad(
            structured[0],
            "cannot constrain a request whose tool_choice already does; drop one of them",
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=max(top_k, 0),
            seed=_int(body, "seed", None),
            stop_token_ids=stop_ids,
            stop=stop,
            ignore_eos=_bool(body, "ignore_eos", False),
            min_tokens=_int(body, "min_tokens", 0, minimum=0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            min_p=_number(body, "min_p", 0.0),
            logit_bias=_logit_bias(body),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=structured[1] if structured is not None else grammar,
            adapter=adapter,
        )
    except InvalidRequestError as exc:
        raise HttpError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
    priority = _int(body, "priority", 0)
    return CompletionRequest(
        ParsedRequest(prompt, params, slo, priority=priority, n=n, prediction=_prediction(body)),
        adapter or model,
        stream,
        include_usage and stream,
        _bool(body, "return_token_ids", False),
        logprobs=logprobs is not None,
    )


def _prediction(body: dict) -> str | list[int] | None:
    """OpenAI's `prediction`: {"type": "content", "content": text, a list of text parts, or
    (this server's extension) token ids}; None when absent."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise _bad("prediction", 'must be {"type": "content", "content": <the expected output>}')
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
        if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise _bad("prediction.content", 'parts must be {"type": "text", "text": ...}')
        return "".join(p["text"] for p in content)
    if isinstance(content, list) and content:
        return _token_ids("prediction.content", content)
    raise _bad(
        "prediction.content",
        f"must be the expected output as text, text parts or token ids, got {_kind(content)}",
    )


# ---- field readers: None (or absent) means the default -----------------------------------
def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (JSON keys are strings) as {int: float}."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", f"must be an object of token id -> bias, got {_kind(bias)}")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) and not (
            isinstance(key, int) and not isinstance(key, bool)
        ):
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}")
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise _bad(
                "logit_bias", f"values must be numbers in [-100, 100], got {_kind(value)} for {key}"
            )
        out[int(key)] = float(value)
    return out or None


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _int(body: dict, name: str, default: Any, *, minimum: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, f"must be an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise _bad(name, f"must be >= {minimum}, got {value}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(name, f"must be a finite number, got {_kind(value)}")
    return float(value)


def _bool(body: dict, name: str, default: bool, *, field: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(field or name, f"must be true or false, got {_kind(value)}")
    return value


def _bad(field: str, why: str) -> HttpError:
    return HttpError(400, f"{field} {why}", param=field)


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return f"{names.get(type(value), type(value).__name__)} ({str(value)[:40]!r})"
