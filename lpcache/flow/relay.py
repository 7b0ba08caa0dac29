"""Passing a backend's answer to the client: a JSON body, or an SSE stream event by event, as it came (comment
lines aside).

A stream is read by a background task into a queue of STREAM_QUEUE_SIZE chunks, so a slow client slows the reader
(backpressure) instead of growing memory. The response watches for the client leaving; when it does, the upstream
is closed (llama-server then stops generating) and the bookkeeping still runs. `finish` is called exactly once, after
the client has the whole answer (or has gone), never before: the client never waits for a save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson
from starlette.types import Message, Receive, Scope, Send

from lpcache.apis.base import Api, Converter
from lpcache.backends.llama import HOP_HEADERS, Upstream
from lpcache.errors import BackendUnreachable, ProxyError
from lpcache.flow.coalesce import Group
from lpcache.flow.guard import send_error
from lpcache.flow.plugin_api import ChatRequest, Serve
from lpcache.flow.record import RequestRecord, now_ns

log = logging.getLogger("lpcache.relay")

_END = object()

Headers = Sequence[tuple[bytes, bytes]]


def _headers(content_type: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type)]


def session_header(session: str | None) -> list[tuple[bytes, bytes]]:
    """`x-lpcache-session`: the session (lpcache's 32-hex id) a session-mode answer was keyed by."""
    return [] if session is None else [(b"x-lpcache-session", session.encode("ascii"))]


def error_body(err: ProxyError) -> bytes:
    return orjson.dumps(err.body())


class ClientWatch:
    """Watches the ASGI receive channel; when the client goes away, it cancels the task sending the answer
    (cheaper than racing every chunk against a disconnect event). `left()` turns that cancellation back into a
    plain "the client is gone".

    `stay`, when set, is asked at that moment: True means others wait for the same answer (coalesced followers), so
    the work goes on without the client (what `send` would send is dropped) until `stop_work` is called."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.stay: Callable[[], bool] | None = None
        self._main = asyncio.current_task()
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                if self.stay is None or not self.stay():
                    self.stop_work()
                return

    def stop_work(self) -> None:
        """Stop the work of a client that is gone (at once, or once nobody else waits for its answer)."""
        if self.gone and self._main is not None:
            self._main.cancel()

    def guard(self, send: Send) -> Send:
        """`send`, dropping what would go to a client that is gone (the work went on for others)."""
        async def guarded(message: Message) -> None:
            if not self.gone:
                await send(message)
        return guarded

    def left(self) -> bool:
        """Call in `except CancelledError`: True (and the cancellation undone) when the client left."""
        if self.gone and self._main is not None:
            self._main.uncancel()
            return True
        return False

    def stop(self) -> None:
        self._task.cancel()


class Source(Protocol):
    """Where an answer comes from (`attempts.Attempts`): the open upstream, a way to try elsewhere while the client
    has had no byte, the headers that describe the try, and the bookkeeping to run once the answer is over."""

    upstream: Upstream | None

    async def retry(self, error: BaseException) -> Upstream: ...

    def headers(self) -> Headers: ...

    def tee(self, chunk: bytes) -> None: ...

    def ended_with(self, tail: bytes) -> None: ...

    def streaming(self) -> None: ...

    def generated(self) -> None: ...

    def finish(self, delivered: bool, complete: bool | None = None) -> None: ...


class JsonRelay:
    """Reads a JSON completion, then sends it unchanged. A 200 whose body is not a JSON object becomes a 502."""

    def __init__(self, source: Source, record: RequestRecord, watch: ClientWatch, api: Api | None = None,
                 body: dict[str, Any] | None = None) -> None:
        self.source = source
        self.record = record
        self.watch = watch
        self.api = api    # turns the answer to `body` into the client's API (Messages), shapes lpcache's errors
        self.body = body or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        delivered = complete = False
        watch = self.watch
        send = watch.guard(send)
        try:
            while True:
                upstream = self.source.upstream
                assert upstream is not None
                try:
                    raw = await upstream.read()
                    self.source.generated()
                    break
                except BackendUnreachable as e:
                    await self.source.retry(e)   # nothing went to the client yet: try elsewhere
            status, body = 200, raw
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError:
                doc = None
            if isinstance(doc, dict):
                self.record.take_usage(doc)
                body = self._converted(raw)
                self.source.tee(body)
            else:
                err = ProxyError("backend answered a body that is not a JSON object", status=502,
                                 type="backend_error", code="provider_non_object")
                self.record.reason = "provider_non_object"
                status, body = err.status, self.api.error(err)[0] if self.api else error_body(err)
            self.record.status = status
            self.record.bytes_out = len(body)
            await send({"type": "http.response.start", "status": status,
                        "headers": [*_headers(b"application/json"), (b"content-length", str(len(body)).encode()),
                                    *self.source.headers()]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            complete = status == 200
            delivered = complete and not _left(watch, self.record)
        except asyncio.CancelledError:
            if not watch.left():
                raise
            self.record.reason = "client_disconnected"
        except ProxyError as e:
            self.record.reason = self.record.reason or "backend_unreachable"
            await _send_error(send, e, self.record, self.api)
        finally:
            watch.stop()
            # An answer read whole leaves a reusable connection; otherwise close it, which also tells
            # llama-server to stop generating.
            if self.source.upstream is not None:
                self.source.upstream.release() if complete else self.source.upstream.close()
            self.source.finish(delivered, complete)


    def _converted(self, raw: bytes) -> bytes:
        """The answer in the client's API; a 200 that cannot be converted is the backend's fault (502)."""
        if self.api is None:
            return raw
        try:
            return self.api.answer(raw, self.body)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ProxyError(f"backend answer cannot be converted: {type(e).__name__}: {e}", status=502,
                             type="backend_error", code="provider_bad_answer") from None


class SseRelay:
    """Streams SSE events exactly as the backend sent them (whole events, without comment lines), noting the time
    to the first event and the `usage` and `timings` of the last events on the way. The response starts with the
    first whole event, so an answer that breaks before it can still be tried elsewhere."""

    def __init__(self, source: Source, record: RequestRecord, watch: ClientWatch, queue_size: int,
                 started: float, api: Api | None = None, convert: Converter | None = None) -> None:
        self.api = api           # shapes lpcache's errors
        self.convert = convert   # turns the upstream's events into the client's API's (Messages)
        self.source = source
        self.record = record
        self.watch = watch
        self.queue_size = queue_size
        self.started = started
        self._tail = b""
        self._done = False   # the last event passed on was [DONE]

    async def _read(self, upstream: Upstream, queue: asyncio.Queue[object]) -> None:
        """The background reader: the upstream's whole events into the queue, then the end marker (or the error).
        The start of an event waits for its end: a stream that breaks halfway through an event must not glue the
        error event to half an event (the client could parse neither), and a stream that breaks before its first
        whole event can still be tried elsewhere. Comment lines (llama-server's keep-alive `:` after
        `sse_ping_interval` seconds of silence) are left out: they are no part of the answer (an SSE reader ignores
        them, a reader that takes every line for `data: <json>` fails on them), nor its first token."""
        end: object = _END
        pending = b""
        try:
            async for chunk in upstream.chunks():
                pending += chunk
                whole = _whole_events(pending)
                if whole:
                    events, pending = _without_comments(pending[:whole]), pending[whole:]
                    if events:
                        await self._queue(queue, events)
            if pending := _without_comments(pending):   # the stream ended without a blank line: its last bytes
                await self._queue(queue, pending)
            self.source.generated()
        except BackendUnreachable as e:
            end = e
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await queue.put(end)

    async def _queue(self, queue: asyncio.Queue[object], events: bytes) -> None:
        if self.record.ttft_ms is None:
            self.record.ttft_ms = (time.perf_counter() - self.started) * 1000.0
        self._scan(events)
        await queue.put(events)

    def _scan(self, chunk: bytes) -> None:
        """Parse only the complete events that carry usage or timings (the last ones), not every token."""
        if b"\n\n" not in chunk and b"\r\n\r\n" not in chunk:
            self._tail += chunk
            return
        events = (self._tail + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        self._tail = events.pop()
        for event in events:
            if b'"timings"' in event or b'"usage"' in event:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        try:
                            doc = orjson.loads(line[5:])
                        except orjson.JSONDecodeError:
                            continue
                        if isinstance(doc, dict):
                            self.record.take_usage(doc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        delivered = False
        watch = self.watch
        send = watch.guard(send)
        reader: asyncio.Future[None] | None = None
        started = complete = False
        try:
            while True:  # one pass per try; a try that breaks before its first event is replaced
                upstream = self.source.upstream
                assert upstream is not None
                queue: asyncio.Queue[object] = asyncio.Queue(maxsize=self.queue_size)
                reader = asyncio.ensure_future(self._read(upstream, queue))
                item = await queue.get()
                if not started and not isinstance(item, bytes):
                    failure = item if isinstance(item, BaseException) else ConnectionResetError("empty answer")
                    await self.source.retry(failure)
                    continue
                break
            content_type = upstream.headers.get("Content-Type", "text/event-stream").encode()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", content_type), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                *self.source.headers()]})
            started = True
            self.source.streaming()
            self.record.status = 200
            try:
                item = await self._pump(send, queue, item)
            except _Unconvertible as e:
                # the client's stream ends with an error event, as llama-server ends a stream that failed
                log.warning("stream_unconvertible backend=%s: %s", self.record.backend, e)
                self.record.reason = "provider_bad_answer"
                event = b"event: error\ndata: " + orjson.dumps({"code": 502, "message": str(e),
                                                                "type": "backend_error"}) + b"\n\n"
                self.source.ended_with(event)
                self.record.bytes_out += len(event)
                await send({"type": "http.response.body", "body": event, "more_body": False})
                return
            if isinstance(item, BaseException) and self._done:
                # The connection broke after the stream's last event: the answer is whole (nothing may follow
                # [DONE]), the connection is not reusable.
                log.info("stream_broke_after_done backend=%s: %s", self.record.backend, item)
                upstream.close()
                self.source.generated()
                await send({"type": "http.response.body", "body": self._last(), "more_body": False})
                complete = True
                delivered = not _left(watch, self.record)
                return
            if isinstance(item, BaseException):
                # Bytes already went out: end the stream with a well-formed error event, never a hang.
                self.record.reason = "backend_unreachable"
                event = b"data: " + orjson.dumps({"error": {
                    "message": f"backend stream broke: {item}",
                    "type": "backend_unreachable", "code": 502}}) + b"\n\n"
                if self.convert is not None:
                    event = self.convert.feed(event) + self.convert.close()
                self.source.ended_with(event)
                self.record.bytes_out += len(event)
                await send({"type": "http.response.body", "body": event, "more_body": False})
                return
            await send({"type": "http.response.body", "body": self._last(), "more_body": False})
            complete = True
            delivered = not _left(watch, self.record)
        except asyncio.CancelledError:
            if not watch.left():
                raise
            self.record.reason = "client_disconnected"
        except ProxyError as e:   # every try failed before a byte went out
            self.record.reason = self.record.reason or "backend_unreachable"
            await _send_error(send, e, self.record, self.api)
        finally:
            watch.stop()
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            if self.source.upstream is not None:
                self.source.upstream.release() if complete else self.source.upstream.close()
            self.source.finish(delivered, complete)

    async def _pump(self, send: Send, queue: asyncio.Queue[object], item: object) -> object:
        """Pass the events on (to the followers, and to the client) until the end marker, returned. Events the
        reader queued while the last ones were written go out together: one write to the client's socket (on a
        loaded CPU the largest share of a streamed answer's cost to lpcache) instead of one each."""
        while isinstance(item, bytes):
            while not queue.empty():
                more = queue.get_nowait()
                if not isinstance(more, bytes):
                    await self._pass(send, item)
                    return more
                item += more
            await self._pass(send, item)
            item = await queue.get()
        return item

    async def _pass(self, send: Send, data: bytes) -> None:
        self._done = data.endswith((b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n"))
        if self.convert is not None:
            try:
                data = self.convert.feed(data)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
                raise _Unconvertible(f"backend stream cannot be converted: {type(e).__name__}: {e}") from e
            if not data:
                return
        self.source.tee(data)
        self.record.bytes_out += len(data)
        await send({"type": "http.response.body", "body": data, "more_body": True})


    def _last(self) -> bytes:
        """What the converter still holds at the stream's end (nothing without one)."""
        if self.convert is None:
            return b""
        data = self.convert.close()
        if data:
            self.source.tee(data)
            self.record.bytes_out += len(data)
        return data


class _Unconvertible(Exception):
    """The upstream's stream could not be turned into the client's API's."""


def _whole_events(data: bytes) -> int:
    """How many bytes at the start of `data` are whole SSE events (up to the end of its last blank line)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _without_comments(events: bytes) -> bytes:
    """SSE events without their comment lines (a line that starts with `:`); an event left with no line goes
    whole, its blank line too. What a conforming SSE reader makes of the stream is unchanged."""
    if not (events.startswith(b":") or b"\n:" in events or b"\r:" in events):
        return events   # the usual case: the bytes as they came
    out, event, kept = bytearray(), bytearray(), False
    for line in events.splitlines(keepends=True):
        if line in (b"\n", b"\r\n", b"\r"):   # the blank line that ends an event
            if kept:
                out += event + line
            event, kept = bytearray(), False
        elif not line.startswith(b":"):
            event += line
            kept = True
    return bytes(out + event)


class FollowerRelay:
    """A coalesced request: it sends the answer of the identical request that went first, from its first byte,
    converted when the two differ in streaming."""

    def __init__(self, group: Group, stream: bool, record: RequestRecord, watch: ClientWatch,
                 done: Callable[[RequestRecord], None], session: str | None = None) -> None:
        self.group, self.stream, self.record, self.watch, self.done = group, stream, record, watch, done
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        following = now_ns()   # the wait for the first request's answer, and the relay of it (`coalesced`)
        try:
            if self.stream and not await self.group.failed_before_start():
                started = False
                async for chunk in self.group.as_stream():
                    if not started:
                        await send({"type": "http.response.start", "status": 200, "headers": [
                            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                            (b"x-lpcache-coalesced", b"true"), *session_header(self.session)]})
                        started, self.record.status = True, 200
                    self.record.bytes_out += len(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                status, body = await self.group.as_json()
                self.record.status, self.record.bytes_out = status, len(body)
                await send({"type": "http.response.start", "status": status, "headers": [
                    *_headers(b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"x-lpcache-coalesced", b"true"), *session_header(self.session)]})
                await send({"type": "http.response.body", "body": body, "more_body": False})
            if self.group.error is not None:
                self.record.reason = "coalesce_leader_failed"
        except asyncio.CancelledError:
            if not self.watch.left():
                raise
            self.record.reason = "client_disconnected"
        finally:
            self.watch.stop()
            self.group.leave()
            self.record.step("coalesced", following, leader_failed=self.group.error is not None)
            self.done(self.record)


class ServedRelay:
    """An answer a prefilter gave without the backend (a result-cache hit); its post-serve cleanup runs after."""

    def __init__(self, served: Serve, record: RequestRecord, done: Callable[[RequestRecord], None],
                 spawn: Callable[[Any], None], view: ChatRequest, session: str | None = None) -> None:
        self.served, self.record, self.done, self.spawn, self.view = served, record, done, spawn, view
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.served.body
        self.record.status, self.record.bytes_out, self.record.cache_hit = self.served.status, len(body), True
        try:
            await send({"type": "http.response.start", "status": self.served.status, "headers": [
                (b"content-type", self.served.content_type.encode()), (b"content-length", str(len(body)).encode()),
                (b"x-lpcache-served-by", b"prefilter"), *session_header(self.session)]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            if self.served.cleanup is not None:
                self.spawn(self.served.cleanup.run(self.view))
            self.done(self.record)


def _left(watch: ClientWatch, record: RequestRecord) -> bool:
    """Whether the client left while the answer was read on for coalesced followers (the record says so)."""
    if watch.gone:
        record.reason = "client_disconnected"
    return watch.gone


async def _send_error(send: Send, err: ProxyError, record: RequestRecord, api: Api | None = None) -> None:
    record.status = err.status
    with contextlib.suppress(Exception):   # the client may be gone: the record still says what it was sent
        record.bytes_out = await send_error(send, err, payload=api.error(err) if api is not None else None)


class PassThrough:
    """Any other route: the backend's status, headers and body, streamed as they come, no slot involved."""

    def __init__(self, upstream: Upstream, record: RequestRecord,
                 done: Callable[[RequestRecord], None] | None = None) -> None:
        self.upstream = upstream
        self.record = record
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k.lower().encode(), v.encode()) for k, v in self.upstream.headers.items()
                   if k.lower() not in HOP_HEADERS or k.lower() == "content-length"]
        self.record.status = self.upstream.status
        watch = ClientWatch(receive)
        try:
            await send({"type": "http.response.start", "status": self.upstream.status, "headers": headers})
            async for chunk in self.upstream.chunks():
                self.record.bytes_out += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.left():
                raise
            self.record.reason = "client_disconnected"
        except BackendUnreachable:
            self.record.reason = "backend_unreachable"
        finally:
            watch.stop()
            self.upstream.close()
            if self.done is not None:
                self.done(self.record)
