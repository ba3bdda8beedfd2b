"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's bodies and answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sloserve.engine.adapters import IN_FLIGHT
from sloserve.engine.client import AdapterControl
from sloserve.errors import AdapterBusyError, InvalidRequestError, UnknownAdapterError
from sloserve.http.auth import BearerAuth
from sloserve.http.errors import HttpError, error_response, http_error_response
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response


class LoraRoutes:
    """Adapters loaded and unloaded while serving, behind the same bearer token as generation."""

    def __init__(
        self, engine: object, auth: BearerAuth, read_json: Callable[[Request], Awaitable[Any]]
    ) -> None:
        self.engine = engine
        self.auth = auth
        self.read_json = read_json

    async def load(self, request: Request) -> Response:
        """{"lora_name", "lora_path"}: the adapter in that folder (under --lora-dir), as that name."""
        return await self._run(request, ("lora_name", "lora_path"), "added")

    async def unload(self, request: Request) -> Response:
        """{"lora_name", "in_flight"?}: requests of it in flight refuse the unload (409, the
        default), are drained ("drain": new ones refused, unloaded when the last finishes) or
        end now with 404 ("abort")."""
        return await self._run(request, ("lora_name",), "removed")

    async def _run(self, request: Request, fields: tuple[str, ...], done: str) -> Response:
        try:
            self.auth.check(request.headers.get("authorization"))
            body = await self.read_json(request)
            if not isinstance(body, dict):
                raise HttpError(400, "the body must be a JSON object")
            values = []
            for field in fields:
                value = body.get(field)
                if not isinstance(value, str) or not value:
                    raise HttpError(400, f"{field} must be a non-empty string", param=field)
                values.append(value)
            in_flight = body.get("in_flight", "refuse")
            if done == "removed" and in_flight not in IN_FLIGHT:
                raise HttpError(
                    400, f"in_flight must be one of {', '.join(IN_FLIGHT)}", param="in_flight"
                )
            engine = self.engine
            if not isinstance(engine, AdapterControl):
                raise HttpError(400, "this engine serves no LoRA adapters")
            if done == "added":
                await engine.load_adapter(*values)
            else:
                await engine.unload_adapter(*values, in_flight)
        except HttpError as exc:
            return http_error_response(exc)
        except UnknownAdapterError as exc:
            return error_response(404, str(exc), param="lora_name", code="model_not_found")
        except AdapterBusyError as exc:
            return error_response(409, str(exc), param="lora_name", code="adapter_in_use")
        except InvalidRequestError as exc:
            return error_response(400, str(exc), code="invalid_adapter")
        return PlainTextResponse(f"Success: LoRA adapter '{values[0]}' {done} successfully.")
