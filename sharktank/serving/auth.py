"""Bearer-key authentication for the API routes, as plain ASGI middleware (it neither buffers
nor wraps streamed answers): a request under ``/v1`` without ``Authorization: Bearer KEY``
gets 401 with an OpenAI error object before anything reads its body; other paths
(``/health``, ``/metrics``) pass untouched. The key is compared in constant time."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol import ApiError

__all__ = ["BearerAuth", "PROTECTED_PREFIX", "key_matches"]

PROTECTED_PREFIX = "/v1"


def key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (constant-time compare)."""
    scheme, _, token = (authorization or "").partition(" ")
    # compare_digest on bytes: its str form takes ASCII only; a wrong scheme still compares.
    same = hmac.compare_digest(token.encode(), api_key.encode())
    return scheme.lower() == "bearer" and same


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


class BearerAuth:
    """ASGI middleware: 401 for a ``/v1`` request whose bearer key is missing or not ``api_key``."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app, self._key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _protected(scope["path"]):
            header = Headers(scope=scope).get("authorization")
            if not key_matches(header, self._key):
                message = "Incorrect API key provided." if header else "You didn't provide an API key: send it as `Authorization: Bearer KEY`."
                response = ApiError(401, message, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
