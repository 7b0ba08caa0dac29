"""The HTTP edge: what one client connection may cost lpcache before a route runs.

lpcache listens on every address by default, so a client that sends a 16 MiB header, 20,000 headers or one byte a
minute must not hold memory or a connection for long. uvicorn's h11 protocol bounds the request head
(`h11_max_incomplete_event_size`: above it, a 431 and the connection closed, nothing more read); a small subclass
adds the deadline uvicorn lacks for a head that comes too slowly (slowloris) and answers its own protocol errors in
OpenAI's JSON shape; `HeaderLimits` bounds the number of headers. The body has its own deadline while it is read
(`guard.read_body`). Use `server_options` wherever lpcache is served (the CLI, the tests' server thread).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from lpcache.config import Settings
from lpcache.errors import ProxyError
from lpcache.flow.guard import send_error

log = logging.getLogger("lpcache.edge")

MAX_HEAD_BYTES = 64 * 1024   # request line and headers; nginx's largest default (4 x 8 KiB) fits 2x over
MAX_HEADERS = 100            # Apache's LimitRequestFields; an OpenAI SDK sends about 15


class HeaderLimits:
    """431 for a request of more than `max_headers` headers (their total size is bounded by h11 already)."""

    def __init__(self, app: ASGIApp, max_headers: int = MAX_HEADERS) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_headers:
            await send_error(send, ProxyError(f"more than {self.max_headers} request headers", status=431,
                                              type="invalid_request_error", code="too_many_headers"),
                             [(b"connection", b"close")])
            return
        await self.app(scope, receive, send)


def _raw_error(status: int, reason: bytes, err: ProxyError) -> bytes:
    body = orjson.dumps(err.body())
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % (status, reason, len(body)) + body)


def edge_protocol(head_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request head: `head_timeout` seconds from the connection's
    start, or from the end of the previous answer, until the next request's head is in (uvicorn's keep-alive
    timeout still closes an idle connection sooner). A connection past it is closed."""

    class EdgeProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _waiting_since: object = None    # the request cycle that was current when the deadline was set

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._waiting_since:
                self._stop_waiting()          # a new request's head is in: the app reads the rest

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:
                self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """h11 refused the request: a head over `max_head_bytes` (431) or one that is not HTTP (400)."""
            if len(self.conn.trailing_data[0]) > max_head_bytes:
                status, reason = 431, b"Request Header Fields Too Large"
                err = ProxyError(f"request head larger than {max_head_bytes} bytes", status=431,
                                 type="invalid_request_error", code="request_header_too_large")
            else:
                status, reason = 400, b"Bad Request"
                err = ProxyError("invalid HTTP request", status=400, type="invalid_request_error",
                                 code="invalid_http_request")
            self._stop_waiting()
            if not self.transport.is_closing():
                self.transport.write(_raw_error(status, reason, err))
                self.transport.close()

        def _await_head(self) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
                self._waiting_since = self.cycle
                self._head_timer = self.loop.call_later(head_timeout, self._head_late)

        def _stop_waiting(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            log.debug("client_timeout peer=%s: no request head within %.0f s, connection closed",
                      self.client[0] if self.client else "-", head_timeout)
            if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
                self.transport.write(_raw_error(408, b"Request Timeout", ProxyError(
                    f"no request head within {head_timeout:g} s", status=408, type="invalid_request_error",
                    code="request_timeout")))
            self.transport.close()

    return EdgeProtocol


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn.Config options that bound what a client connection may hold (head size, head deadline)."""
    return {"http": edge_protocol(settings.client_timeout), "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
