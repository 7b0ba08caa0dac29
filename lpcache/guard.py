"""The gate: client keys (plain ASGI middleware, before any route), and the body's size limit and deadline (while
reading it).

All answer in OpenAI's error shape. Keys are compared in constant time and never logged; where a key must be told
apart from another (whose session is whose), only a digest of it is kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Sequence

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ClientGoneReading, ProxyError

OPEN_PATHS = frozenset({"/health"})  # a load balancer's health check needs no key


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, else None."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def send_error(send: Send, err: ProxyError, extra: Sequence[tuple[bytes, bytes]] = ()) -> int:
    """Send `err` in OpenAI's shape on a raw ASGI channel; returns the body's size."""
    body = orjson.dumps(err.body())
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return len(body)


class ApiKeys:
    """401 for a request without `Authorization: Bearer <key>` of a configured key (GET /health excepted)."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self.app = app
        self.keys = [k.encode() for k in keys]

    def allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = bearer_token(value.decode("latin-1"))
                if token is not None:
                    # compare with every key, so the time taken does not tell which one nearly matched
                    return any([hmac.compare_digest(token.encode("latin-1"), k) for k in self.keys])
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        await send_error(send, ProxyError("invalid or missing API key (Authorization: Bearer <key>)", status=401,
                                          type="authentication_error", code="invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])


def key_digest(token: str) -> str:
    """A short stand-in for a client key, to tell whose a session is without keeping the key."""
    return hashlib.sha256(b"lpcache client key\n" + token.encode("latin-1", "replace")).hexdigest()[:16]


async def read_body(request: Request, max_bytes: int, idle_timeout: float | None = None) -> bytes:
    """The request body, or 413 as soon as it is known to pass `max_bytes`: from Content-Length before reading,
    else while the chunks come in (a chunked upload is not read to its end). 408 when no part of it comes for
    `idle_timeout` seconds (a slow client would hold its connection forever); ClientGoneReading when the client
    left."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large(max_bytes)
    chunks: list[bytes] = []
    seen = 0
    parts = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_timeout):
                chunk = await anext(parts)
        except StopAsyncIteration:
            return b"".join(chunks)
        except ClientDisconnect:
            raise ClientGoneReading() from None
        except TimeoutError:
            raise ProxyError(f"no part of the request body came for {idle_timeout:g} s (CLIENT_TIMEOUT)",
                             status=408, type="invalid_request_error", code="request_timeout") from None
        seen += len(chunk)
        if seen > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)


def too_large(max_bytes: int) -> ProxyError:
    return ProxyError(f"request body larger than {max_bytes} bytes (MAX_BODY_BYTES)", status=413,
                      type="invalid_request_error", code="request_too_large")
