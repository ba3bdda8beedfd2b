"""The OpenAI-compatible routes (Starlette): /v1/completions, /v1/chat/completions, /v1/score,
/v1/models, /tokenize, /detokenize, /health, /metrics, /version, and the /server_info and
/model_info a router reads -- a thin adapter over the front end."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sloserve import __version__
from sloserve.errors import InvalidRequestError
from sloserve.frontend import Failure, FailureCode, RequestHandle, ServerState
from sloserve.frontend.bearer import bearer_matches
from sloserve.frontend.chat import NO_TEMPLATE, ChatTemplate
from sloserve.frontend.chat_files import template_from_checkpoint, template_from_file
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.frontend.score import run_score
from sloserve.http.auth import BearerAuth
from sloserve.http.completions import Completions, watch_disconnect
from sloserve.http.config import HttpConfig
from sloserve.http.errors import HttpError, error_response, failure_response, http_error_response
from sloserve.http.logprobs import LogprobFormat
from sloserve.http.lora import LoraRoutes
from sloserve.http.request_id import GENERATED, RequestIdMiddleware
from sloserve.http.responses import Shape
from sloserve.http.schemas import CompletionRequest, parse_chat, parse_completion
from sloserve.http.score import parse_score, score_response
from sloserve.http.slo import slo_from_wire
from sloserve.http.tokenize import Tokenization
from sloserve.logs import Throttled
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

log = logging.getLogger(__name__)
_notices = Throttled(log)


class HttpApi:
    """The routes over one Lifecycle's front end; `app` is the ASGI application."""

    def __init__(self, lifecycle: Lifecycle, http: HttpConfig) -> None:
        self.lifecycle = lifecycle
        self.frontend = lifecycle.frontend
        self.config = lifecycle.config
        self.model = http.model_name or self.config.model.path
        self.auth = BearerAuth(self.config.server.auth_token)
        self.max_body_bytes = http.max_body_bytes
        self.completions = Completions(self.frontend, http.stream_stall_s)
        self.created = int(time.time())
        # --chat-template is read (and must compile) at start-up; the checkpoint's once it is loaded
        self._override = template_from_file(http.chat_template) if http.chat_template else None
        self._template: ChatTemplate | None = None
        self._template_resolved = False
        self.tokenization = Tokenization(self.frontend, self._render)
        lora = LoraRoutes(self.frontend.engine, self.auth, self._json)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.create_completion, methods=["POST"]),
                Route("/v1/chat/completions", self.create_chat_completion, methods=["POST"]),
                Route("/v1/score", self.score, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.retrieve_model, methods=["GET"]),
                Route("/v1/load_lora_adapter", lora.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/server_info", self.server_info, methods=["GET"]),
                Route("/model_info", self.model_info, methods=["GET"]),
            ],
            exception_handlers={404: _not_found, 405: _not_allowed},
            middleware=[Middleware(RequestIdMiddleware)],
        )

    # ---- generation ------------------------------------------------------------------------
    async def create_completion(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def create_chat_completion(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        # the one arrival stamp: every time of the request counts from here
        arrival = time.monotonic()
        frontend = self.frontend
        try:
            self.auth.check(request.headers.get("authorization"))
            body = await self._json(request)
            frontend.check_open()  # 503 while loading or draining, whatever the body says
            slo = slo_from_wire(request.headers, body)
            # NOTE: a chat without max_tokens may use the context left (capped by --max-tokens-limit), as
            # OpenAI's API does; the engine ends it at the context length. Completions keep the short default.
            default = frontend.limits.max_tokens_limit if chat else frontend.default_max_tokens
            common = {"model": self.model, "default_max_tokens": default, "slo": slo}
            req = (
                parse_chat(body, self._render, **common)
                if chat
                else parse_completion(body, **common)
            )
            frontend.check(req.parsed, req.prompts or ())
        except HttpError as exc:
            if exc.status == 400:
                frontend.count_failure(
                    Failure(FailureCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
                )
            return http_error_response(exc)
        except ClientDisconnect:  # gone mid-body (or cut by --http-body-timeout): nothing to answer
            _notices.log(
                logging.INFO,
                "disconnect",
                "an HTTP client went away before its request body arrived",
            )
            if frontend.metrics is not None:
                frontend.metrics.request_done("cancelled")
            return Response(status_code=499)  # never sent: the connection is gone
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            return failure_response(frontend.failure(exc), chat=chat)
        engine_id = f"http-{request.scope.get(GENERATED) or uuid.uuid4().hex}"
        # the caller's id, for logs and tracing
        if client_id := request.headers.get("x-request-id"):
            engine_id += f":{client_id[:128]}"
        handle = RequestHandle(engine_id, arrival)
        return await self.completions.respond(request, handle, req, self._shape(chat, req))

    async def score(self, request: Request) -> Response:
        """POST /v1/score: per candidate continuation of one prompt, its tokens' logprobs (http/score.py)."""
        arrival = time.monotonic()
        frontend = self.frontend
        try:
            self.auth.check(request.headers.get("authorization"))
            body = await self._json(request)
            frontend.check_open()
            slo = slo_from_wire(request.headers, body)
            parsed = parse_score(
                body, self.config.server.max_score_candidates, frontend.limits.max_logprobs
            )
            engine_id = f"http-{request.scope.get(GENERATED) or uuid.uuid4().hex}"
            if client_id := request.headers.get("x-request-id"):
                engine_id += f":{client_id[:128]}"
            run = asyncio.create_task(run_score(frontend, engine_id, arrival, parsed, slo))
            # the client went away: cancelling the call aborts every candidate in the engine
            watcher = watch_disconnect(request, run.cancel)
            try:
                outcome = await run
            except asyncio.CancelledError:
                return Response(status_code=499)  # never sent: the connection is gone
            except InvalidRequestError as exc:
                param = "prompt" if str(exc).startswith("prompt") else "candidates"
                raise HttpError(400, str(exc), param=param) from None
            finally:
                watcher.cancel()
        except HttpError as exc:
            if exc.status == 400:
                frontend.count_failure(
                    Failure(FailureCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
                )
            return http_error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            return failure_response(frontend.failure(exc))
        if isinstance(outcome, Failure):
            return failure_response(outcome)
        prompt_tokens, outs = outcome
        return _json(score_response(self.model, prompt_tokens, outs, parsed.top_logprobs))

    def _shape(self, chat: bool, req: CompletionRequest) -> Shape:
        """How the request's responses look: with logprobs' token texts and echo's prompt when asked."""
        tokenizer = self.frontend.engine.tokenizer
        logprobs = LogprobFormat(tokenizer.decode) if req.logprobs else None
        echo = None
        if req.echo:
            texts = [
                p if isinstance(p, str) else tokenizer.decode(p)
                for p in req.prompts or [req.parsed.prompt]
            ]
            echo = texts if req.prompts else texts[0]
        return Shape(
            chat,
            req.model,
            req.return_token_ids,
            logprobs,
            echo,
            req.include_usage,
            tools=req.tools is not None,
        )

    def _render(self, messages: list[dict], tools: list[dict] | None = None, **options: Any) -> str:
        template = self._chat_template()
        if template is None:
            raise HttpError(400, NO_TEMPLATE, param="messages", code="no_chat_template")
        if not tools:
            return template.render(messages, **options)
        prompt = template.render(messages, tools=tools, **options)
        if prompt == template.render(messages, **options):  # the model would never see them
            raise HttpError(
                400,
                f"tools: this model's chat template ({template.origin}) does not render tools; "
                "start the server with a --chat-template that does, or omit tools",
                param="tools",
            )
        return prompt

    def _chat_template(self) -> ChatTemplate | None:
        """--chat-template, else the checkpoint's; resolved once the model (its folder) is loaded."""
        if not self._template_resolved:
            folder = self.frontend.engine.model_info.get("model")
            if self._override is not None:
                if folder:
                    self._override = template_from_file(self._override.origin, str(folder))
                self._template = self._override
            elif folder:
                self._template = template_from_checkpoint(str(folder))
            self._template_resolved = bool(folder)
        return self._template

    async def _json(self, request: Request) -> Any:
        """The body as JSON, read chunk by chunk: a body past --http-max-body-size is refused as it
        arrives (a chunked upload has no length to check first), never held whole."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(f"{declared} bytes", limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit} bytes", limit)
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise HttpError(400, f"the request body is not valid JSON: {exc}") from None

    # ---- the rest --------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        try:
            self.auth.check(request.headers.get("authorization"))
        except HttpError as exc:
            return http_error_response(exc)
        cards = [self._model_card(), *(self._model_card(a) for a in self._adapters())]
        return _json({"object": "list", "data": cards})

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model, or 404 model_not_found."""
        try:
            self.auth.check(request.headers.get("authorization"))
        except HttpError as exc:
            return http_error_response(exc)
        requested = request.path_params["model"]
        if requested == self.model:
            return _json(self._model_card())
        if requested in self._adapters():
            return _json(self._model_card(requested))
        return error_response(
            404,
            f"model {requested!r} is not served here; this server serves {self.model!r}",
            param="model",
            code="model_not_found",
        )

    def _adapters(self) -> list[str]:
        """The LoRA adapters loaded (none where the engine serves none)."""
        names = getattr(self.frontend.engine, "adapter_names", None)
        return names() if names is not None else []

    def _model_card(self, adapter: str | None = None) -> dict:
        """The served model's card, or a LoRA adapter's (vLLM's: its `parent` the served model)."""
        max_len = int(self.frontend.engine.model_info.get("max_model_len") or 0) or None
        card = {
            "id": adapter or self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "sloserve",
            "max_model_len": max_len,
        }
        if adapter is not None:
            card |= {"root": adapter, "parent": self.model}
        return card

    # ---- tokens ----------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        return await self._tokens(request, self.tokenization.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens(request, self.tokenization.detokenize)

    async def _tokens(self, request: Request, answer: Any) -> Response:
        try:
            self.auth.check(request.headers.get("authorization"))
            body = await self._json(request)
            self.frontend.check_open()
            if not isinstance(body, dict):
                raise HttpError(400, "the request body must be a JSON object")
            requested = body.get("model")
            # an adapter tokenizes with the served model's tokenizer
            if requested is not None and requested not in (self.model, *self._adapters()):
                raise HttpError(
                    404,
                    f"model {requested!r} is not served here; this server serves {self.model!r}",
                    param="model",
                    code="model_not_found",
                )
            return _json(answer(body))
        except HttpError as exc:
            return http_error_response(exc)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            return failure_response(self.frontend.failure(exc))

    async def health(self, request: Request) -> Response:
        """Readiness: 200 while serving; 503 while loading, draining, stuck or dead."""
        state = self.frontend.state
        if self.lifecycle.ready and state == ServerState.SERVING:
            return _json({"status": "serving"})
        reason = "stuck" if state == ServerState.SERVING else state.value
        return error_response(503, f"not ready: {reason}", code=reason)

    async def metrics(self, request: Request) -> Response:
        """The Prometheus text; with --metrics-token, only to a scrape that sends it as a bearer token."""
        token = self.config.server.metrics_token
        if token is not None and not bearer_matches(request.headers.get("authorization"), token):
            return error_response(
                401,
                "missing or wrong bearer token: scrape /metrics with "
                "'Authorization: Bearer <--metrics-token>'",
                code="invalid_token",
            )
        return Response(
            generate_latest(self.lifecycle.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def version(self, request: Request) -> Response:
        return _json({"version": __version__})

    # ---- what a router reads when it registers this server as a worker -----------------------
    # NOTE: SGLang Model Gateway (smg) reads these at registration, by SGLang's field names: the
    # model id it routes by is served_model_name (else model_path), and it loads its own tokenizer
    # from tokenizer_path (else model_path) when that folder exists where the router runs. Only
    # what this server really has is answered; a 404 or a missing field leaves the router's default.
    async def server_info(self, request: Request) -> Response:
        """The served model and the limits of this replica (SGLang's /server_info field names)."""
        info, failure = self._loaded_info(request)
        if failure is not None:
            return failure
        blocks, block = info.get("num_kv_blocks"), info.get("block_size")
        return _json(
            _present(
                {
                    "model_path": info.get("model"),
                    "tokenizer_path": info.get("model"),
                    "served_model_name": self.model,
                    "version": __version__,
                    "context_length": info.get("max_model_len"),
                    "max_total_tokens": blocks * block
                    if blocks and block
                    else None,  # the KV pool, in tokens
                    "max_running_requests": self.config.scheduler.max_batch,
                    "tp_size": self.config.parallel.tensor_parallel_size,
                }
            )
        )

    async def model_info(self, request: Request) -> Response:
        """The loaded checkpoint (SGLang's /model_info field names)."""
        info, failure = self._loaded_info(request)
        if failure is not None:
            return failure
        architecture = info.get("architecture")
        return _json(
            _present(
                {
                    "model_path": info.get("model"),
                    "tokenizer_path": info.get("model"),
                    "is_generation": True,
                    "architectures": [architecture] if architecture else None,
                }
            )
        )

    def _loaded_info(self, request: Request) -> tuple[dict, Response | None]:
        """The engine's model_info, or the error to answer: 401 without the token, 503 before loading."""
        try:
            self.auth.check(request.headers.get("authorization"))
        except HttpError as exc:
            return {}, http_error_response(exc)
        if not self.frontend.engine.ready:
            return {}, error_response(
                503, "the model is still loading; retry when /health says 200", code="not_ready"
            )
        return dict(self.frontend.engine.model_info), None


def _too_large(size: str, limit: int) -> HttpError:
    return HttpError(
        413,
        f"the request body has {size}, over this server's limit of {limit} (--http-max-body-size)",
        code="body_too_large",
    )


def _json(payload: dict) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _present(fields: dict) -> dict:
    """The fields that have a value (an unknown one is left out, not guessed)."""
    return {key: value for key, value in fields.items() if value is not None}


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(
        404,
        f"no route {request.url.path}: this server answers /v1/completions, "
        "/v1/chat/completions, /v1/score, /v1/models, /tokenize, /detokenize, /health, /metrics, /version, "
        "/server_info and /model_info",
    )


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} is not allowed on {request.url.path}")
