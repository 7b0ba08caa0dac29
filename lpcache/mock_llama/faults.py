"""Injected faults: what is armed, and the middleware that applies them.

Faults model an upstream that misbehaves: slow, erroring, dropping the connection
before a byte is sent, never answering, cutting a stream, or sending half of an
answer's body (any answer: an error, ``/slots``, ``/props``, ``/health``, a save) and
then cutting the connection (``body_cut``) or going silent (``body_stall``). ``drop`` and the stream
cut act on the real TCP connection, which uvicorn does not expose to the app; the
app captures it from uvicorn's ``send`` (see ``capture_transport``).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any

from starlette.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lpcache.mock_llama.errors import error_response

INFERENCE_PATHS = ("/v1/chat/completions", "/chat/completions", "/completion", "/completions", "/v1/completions")
TRANSPORT_KEY = "lpcache.mock.transport"


@dataclass
class Faults:
    """Armed faults. Counts go down as requests consume them; -1 means every request."""

    latency_ms: float = 0.0
    status: int | None = None
    status_count: int = -1
    status_page: bool = False  # a `status` answer is a front web server's HTML page, not llama-server's JSON error
    drop: int = 0
    hang: int = 0
    stream_break_after: int | None = None
    stream_break_count: int = -1
    stream_break_half: bool = False  # the stream break comes halfway through the event after those passed on
    save_status: int | None = None
    save_fail_count: int = -1
    save_short: int = 0  # saves whose file is cut short while the answer says all was written (a full disk)
    body_cut: int = 0
    body_stall: int = 0
    paths: tuple[str, ...] = INFERENCE_PATHS  # where latency/status/drop/hang/body_cut/body_stall apply

    def update(self, data: dict[str, Any]) -> None:
        """Set the given fields, all or none; ValueError names the first bad one."""
        known = {f.name for f in fields(self)}
        new = asdict(self)
        for key, value in data.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}")
            new[key] = _check(key, value)
        for key, value in new.items():
            setattr(self, key, value)

    def reset(self) -> None:
        """Disarm everything (in place: the middleware holds this object)."""
        for f in fields(self):
            setattr(self, f.name, getattr(_DEFAULTS, f.name))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["paths"] = list(self.paths)
        return out

    def take_status(self) -> int | None:
        return self._take("status", "status_count")

    def take_save_status(self) -> int | None:
        return self._take("save_status", "save_fail_count")

    def take_save_short(self) -> bool:
        return self._take_one("save_short")

    def take_stream_break(self) -> int | None:
        return self._take("stream_break_after", "stream_break_count")

    def take_drop(self) -> bool:
        return self._take_one("drop")

    def take_hang(self) -> bool:
        return self._take_one("hang")

    def take_body_break(self) -> str | None:
        """"cut" or "stall" when this answer's body is to break halfway."""
        return "cut" if self._take_one("body_cut") else "stall" if self._take_one("body_stall") else None

    def _take(self, name: str, count_name: str) -> int | None:
        """The armed value for one request, if any; disarms it when its count runs out."""
        value: int | None = getattr(self, name)
        count: int = getattr(self, count_name)
        if value is None or count == 0:
            return None
        if count == 1:  # last use: disarm, and reset the count for the next arming
            setattr(self, name, None)
            setattr(self, count_name, -1)
        elif count > 1:
            setattr(self, count_name, count - 1)
        return value

    def _take_one(self, name: str) -> bool:
        if getattr(self, name) <= 0:
            return False
        setattr(self, name, getattr(self, name) - 1)
        return True


_DEFAULTS = Faults()


def _check(key: str, value: Any) -> Any:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if key == "latency_ms":
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    elif key in ("status", "save_status"):
        ok = value is None or (is_int(value) and 100 <= value <= 599)
    elif key in ("status_count", "stream_break_count", "save_fail_count"):
        ok = is_int(value) and value >= -1
    elif key in ("drop", "hang", "body_cut", "body_stall", "save_short"):
        ok = is_int(value) and value >= 0
    elif key in ("stream_break_half", "status_page"):
        ok = isinstance(value, bool)
    elif key == "stream_break_after":
        ok = value is None or (is_int(value) and value >= 0)
    else:  # paths
        ok = isinstance(value, list | tuple) and all(isinstance(p, str) for p in value)
        value = tuple(value) if ok else value
    if not ok:
        raise ValueError(f"bad value for fault {key!r}: {value!r}")
    return value


def capture_transport(scope: Scope, send: Send) -> None:
    """Remember the connection's transport, reachable through uvicorn's bound ``send``.

    It must be read before Starlette wraps ``send``. Under other servers (or httpx's
    ASGITransport) there is none, and the connection faults fall back to exceptions.
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None:
        scope[TRANSPORT_KEY] = transport


def reset_connection(scope: Scope) -> bool:
    """Abort the connection with a TCP reset, whatever is buffered; False if unreachable."""
    transport = scope.get(TRANSPORT_KEY)
    if transport is None:
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
    return True


async def cut_connection(scope: Scope) -> None:
    """Close the connection after what was already written has left (no reset)."""
    transport = scope.get(TRANSPORT_KEY)
    if transport is None:
        raise ConnectionAbortedError("mock fault: stream cut")
    for _ in range(1000):  # bounded wait for the socket to drain
        if not transport.get_write_buffer_size():
            break
        await asyncio.sleep(0.001)
    # abort, not close: close would let the server's final chunk terminator out too.
    transport.abort()
    await asyncio.sleep(0)  # let uvicorn see the loss before the response ends


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


class _BodyBroken(Exception):
    """The answer's body was broken on purpose: the app's response ends here."""


class FaultMiddleware:
    """Applies latency, hang, drop, status and body faults to requests on ``faults.paths``."""

    def __init__(self, app: ASGIApp, faults: Faults, closing: asyncio.Event) -> None:
        self.app = app
        self.faults = faults
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.faults.paths:
            await self.app(scope, receive, send)
            return
        if self.faults.latency_ms:
            await asyncio.sleep(self.faults.latency_ms / 1000)
        how = self.faults.take_body_break()
        if how is not None:
            send = self._breaking(scope, receive, send, how)
        try:
            await self._apply(scope, receive, send)
        except _BodyBroken:
            pass

    def _breaking(self, scope: Scope, receive: Receive, send: Send, how: str) -> Send:
        """A ``send`` that lets the headers and half of the first body chunk out, then cuts or goes silent."""

        async def breaking(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            body = message.get("body", b"")
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            if how == "cut":
                await cut_connection(scope)
            else:
                await self._hang(scope, receive)
            raise _BodyBroken()

        return breaking

    async def _apply(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.faults.take_hang():
            await self._hang(scope, receive)
        elif self.faults.take_drop():
            if not reset_connection(scope):
                raise ConnectionResetError("mock fault: drop")
            await wait_disconnect(receive)
        elif (status := self.faults.take_status()) is not None:
            if self.faults.status_page:
                page = f"<html><head><title>{status} Bad Gateway</title></head><body><h1>{status}</h1></body></html>"
                await HTMLResponse(page, status)(scope, receive, send)
            else:
                await error_response(status, "mock fault: injected status")(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _hang(self, scope: Scope, receive: Receive) -> None:
        """Answer nothing until the client leaves or the server stops."""
        tasks = {asyncio.ensure_future(wait_disconnect(receive)), asyncio.ensure_future(self.closing.wait())}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
        if self.closing.is_set() and reset_connection(scope):
            await wait_disconnect(receive)
