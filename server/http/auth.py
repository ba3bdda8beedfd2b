"""The bearer token of `--auth-token`, checked on the API routes (health, metrics and version are open)."""

from __future__ import annotations

from sloserve.frontend.bearer import bearer_matches
from sloserve.http.errors import HttpError


class BearerAuth:
    """`Authorization: Bearer <token>` (the scheme in any case), compared in constant time; no token: all pass."""

    def __init__(self, token: str | None) -> None:
        self._token = token or None

    def check(self, authorization: str | None) -> None:
        if self._token is None:
            return
        if authorization is None:
            raise HttpError(
                401,
                "missing bearer token: send the header 'Authorization: Bearer <token>'",
                code="missing_token",
            )
        if not bearer_matches(authorization, self._token):
            raise HttpError(
                401,
                "wrong bearer token: check the token given to the server with --auth-token",
                code="invalid_token",
            )
