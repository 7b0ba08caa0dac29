"""The HTTP edge: what one client connection may cost lpcache before a route runs.

lpcache listens on every address by default, so a client that sends a 16 MiB header, 20,000 headers or one byte a
minute must not hold memory or a connection for long. The protocol is uvicorn's httptools one (llhttp, in C: about
0.2 ms a request quicker than its pure-Python h11 one on the proxy's own path, docs/benchmarks.md) with what it lacks
added by a small subclass: a bound on the request head (above MAX_HEAD_BYTES, a 431 and the connection closed,
nothing more read; llhttp itself has none), a deadline for a head that comes too slowly (slowloris), and its own
protocol errors answered in OpenAI's JSON shape; `HeaderLimits` bounds the number of headers. The body has its own
deadline while it is read (`guard.read_body`). Use `server_options` wherever lpcache is served (the CLI, the tests'
server thread).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lpcache.config import Settings
from lpcache.errors import ProxyError
from lpcache.flow.guard import send_error

log = logging.getLogger("lpcache.edge")

MAX_HEAD_BYTES = 64 * 1024   # request line and headers; nginx's largest default (4 x 8 KiB) fits 2x over
MAX_HEADERS = 100            # Apache's LimitRequestFields; an OpenAI SDK sends about 15


class HeaderLimits:
    """431 for a request of more than `max_headers` headers (their total size is bounded by `edge_protocol`)."""

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


def edge_protocol(head_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a bound on each request head (`max_head_bytes`: the request line and headers
    read before the head's end) and a deadline for it: `head_timeout` seconds from the connection's start, or from
    the end of the previous answer, until the next request's head is in (uvicorn's keep-alive timeout still closes an
    idle connection sooner). A connection past either is answered and closed."""

    class EdgeProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True        # bytes now read belong to a request head (none of a body yet)
        _head_bytes = 0        # read since the last request's body ended (or the connection began)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > max_head_bytes and not self.transport.is_closing():
                # the head is not whole after more than the bound: refused before another byte is read (llhttp
                # has parsed this chunk, one read of the transport at most)
                self._refuse(431, b"Request Header Fields Too Large", ProxyError(
                    f"request head larger than {max_head_bytes} bytes", status=431, type="invalid_request_error",
                    code="request_header_too_large"))

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._stop_waiting()          # the head is in: the app reads the rest, under its own deadline
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0   # what comes next is the next request's head

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:
                self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """llhttp refused the request: not HTTP (or not HTTP lpcache serves)."""
            self._refuse(400, b"Bad Request", ProxyError("invalid HTTP request", status=400,
                                                         type="invalid_request_error", code="invalid_http_request"))

        def _refuse(self, status: int, reason: bytes, err: ProxyError) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
                self.transport.write(_raw_error(status, reason, err))
                self.transport.close()

        def _await_head(self) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
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
            if self.cycle is None or self.cycle.response_complete:   # no answer under way to cut into
                self.transport.write(_raw_error(408, b"Request Timeout", ProxyError(
                    f"no request head within {head_timeout:g} s", status=408, type="invalid_request_error",
                    code="request_timeout")))
            self.transport.close()

    return EdgeProtocol


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn.Config options that bound what a client connection may hold (head size, head deadline)."""
    return {"http": edge_protocol(settings.client_timeout)}
