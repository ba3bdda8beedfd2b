"""The bearer-token check both edges share: `Bearer <token>`, the scheme in any case (RFC 7235 section 2.1)."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization value carries `token` under the Bearer scheme (compared in constant time)."""
    if authorization is None:
        return False
    scheme, _, credentials = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credentials.strip().encode(), token.encode()
    )
