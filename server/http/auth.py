"""The bearer token of `--auth-token`, checked on the API routes (health, metrics and version are open)."""

from __future__ import annotations

import hmac

from sloserve.http.errors import HttpError


class BearerAuth:
    """`Authorization: Bearer <token>`, compared in constant time; no token configured: all pass."""

    def __init__(self, token: str | None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    def check(self, authorization: str | None) -> None:
        if self._expected is None:
            return
        if authorization is None:
            raise HttpError(401, "missing bearer token: send the header 'Authorization: Bearer <token>'",
                            code="missing_token")
        if not hmac.compare_digest(authorization.encode(), self._expected):
            raise HttpError(401, "wrong bearer token: check the token given to the server with --auth-token",
                            code="invalid_token")
