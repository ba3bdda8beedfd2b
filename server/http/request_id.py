"""x-request-id on every response: the client's own id echoed, or one generated for it."""

from __future__ import annotations

import uuid
from typing import Any

HEADER = b"x-request-id"
GENERATED = "sloserve.generated_request_id"  # scope key: the id made here when the client sent none


class RequestIdMiddleware:
    """Pure ASGI middleware (no task, no body buffering): it only adds one response header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == HEADER), None)
        if value is None:
            scope[GENERATED] = uuid.uuid4().hex
            value = scope[GENERATED].encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, value)]
            await send(message)

        await self.app(scope, receive, send_with_id)
