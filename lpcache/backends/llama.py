"""llama-server's HTTP API, and nothing else: every URL, field and status lpcache relies on lives here.

Built on aiohttp: against a zero-latency stand-in it added less time per request than httpx (see
docs/benchmarks.md, `bench/http_clients.py`). aiohttp errors are translated into `BackendUnreachable` here, at the
seam, with the original chained: sending, and every read of an answer (an error body, `/slots`, `/props`, a stream),
so the rest of lpcache sees only its own errors. A chat answer comes back as an `Upstream`, whose reads do the same.

llama-server closes a keep-alive connection after 5 s idle; the pool keeps them 4 s (`client_session`). A request
sent on a pooled connection that turns out closed anyway is sent again at once on another connection (aiohttp does
so itself only for GET and the other idempotent methods, not for a chat or a save).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NoReturn
from urllib.parse import urlencode

import aiohttp
import orjson

from lpcache.errors import BackendError, BackendUnreachable, BadRequest

log = logging.getLogger("lpcache.llama")

CHAT_PATH = "/v1/chat/completions"

KEEPALIVE_SECONDS = 4.0    # below llama-server's own idle keep-alive (5 s)
STALE_RETRIES = 16         # resends at once while pooled connections turn out closed (a restarted server's all are)
STALE_BREAK_SECONDS = 0.2  # a pooled connection found closed breaks within milliseconds; later, the server had worked
ERROR_BODY_SECONDS = 10.0  # an error answer's body comes with its headers: longer is a stalled server

# What aiohttp or the OS raise when a connection fails or a read times out.
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)

# The headers that carry a client's credential (llama-server reads Authorization, else X-Api-Key): the edge checks
# them (`guard`), and a request to a backend with its own key never passes the client's on.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")

# Headers that belong to one hop (RFC 9110 7.6.1) or that aiohttp sets itself.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})


def pin(body: dict[str, Any], slot: int) -> dict[str, Any]:
    """Write the slot pin where every llama-server build looks: the body root and `options` (the query string is
    added by `chat`). Build 11434 reads only the root; the others are harmless there."""
    body["id_slot"] = slot
    options = body.get("options")
    body["options"] = {**options, "id_slot": slot} if isinstance(options, dict) else {"id_slot": slot}
    return body


def unpin(body: dict[str, Any]) -> dict[str, Any]:
    """No slot pin anywhere a build looks (the server chooses the slot): neither one an earlier try wrote nor the
    client's own."""
    body.pop("id_slot", None)
    options = body.get("options")
    if isinstance(options, dict) and "id_slot" in options:
        body["options"] = {k: v for k, v in options.items() if k != "id_slot"}
    return body


@dataclass(frozen=True, slots=True)
class SlotAction:
    """The answer to POST /slots/{id}?action=...: ok, the status, the JSON body (or an error text)."""

    ok: bool
    status: int
    body: dict[str, Any]
    ms: float

    @property
    def work_ms(self) -> float:
        """What the server spent on the file itself (its `timings.save_ms` or `restore_ms`), without the time the
        action waited behind other slots' batches, which a busy server adds to `ms`; `ms` when it does not say."""
        timings = self.body.get("timings")
        if isinstance(timings, dict):
            for name in ("save_ms", "restore_ms"):
                value = timings.get(name)
                if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                    return float(value)
        return self.ms

    def count(self, name: str) -> int | None:
        """A count the server reports (`n_saved`, `n_written`, `n_restored`, `n_read`): an int, else None."""
        value = self.body.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def error(self) -> str:
        err = self.body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err or self.body)

    @property
    def unreadable_file(self) -> bool:
        """A restore refused for the file itself: llama-server's one message for a missing, unreadable or foreign
        file ("No available space in KV cache or invalid slot save file"); not a file too long for the slot, not
        a server that failed otherwise."""
        return not self.ok and self.status == 400 and "invalid slot save file" in self.error.lower()


MESSAGE_CHARS = 300   # the most of a backend's error text a log line or an error message carries
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """Text for one log line: whitespace runs (newlines too) made one space, cut at `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def body_text(raw: bytes) -> str:
    """What a non-JSON error body says, in one short line: an HTML page by its title (or its text without the
    tags), other text as it is; its size when cut."""
    if raw.lstrip()[:1] == b"<":
        title = _TITLE.search(raw)
        text = title.group(1).decode("utf-8", "replace") if title else _TAG.sub(" ", raw.decode("utf-8", "replace"))
        shown = "HTML page: " + one_line(text)
    else:
        shown = one_line(raw.decode("utf-8", "replace"))
    return shown if len(raw) <= MESSAGE_CHARS else f"{shown} ({len(raw):,} bytes)"


def error_message(status: int, raw: bytes) -> tuple[str, str | None]:
    """The message (and type) of a backend's error body, whatever its shape, in one line of bounded length (the
    body itself goes to the client as it came)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return (body_text(raw) if raw.strip() else f"backend answered HTTP {status}"), None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return one_line(str(err.get("message") or f"backend answered HTTP {status}")), err.get("type")
    if isinstance(err, str):
        return one_line(err), None
    return f"backend answered HTTP {status}", None


def unreachable(url: str, e: BaseException, what: str = "unreachable") -> BackendUnreachable:
    err = BackendUnreachable(f"backend {url} {what}: {type(e).__name__}: {e}", code="backend_unreachable")
    err.__cause__ = e
    return err


async def _note_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


def client_session() -> aiohttp.ClientSession:
    """The aiohttp session lpcache talks to its backends with: one pool, connections kept idle below
    llama-server's keep-alive, and told when a request went out on a pooled connection (see `_send`)."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_note_reuse)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
                                 trace_configs=[trace])


class Upstream:
    """A backend's open answer. Its reads raise BackendUnreachable (the connection broke, the read timed out),
    never aiohttp's errors. The caller releases it (`release` when read whole, so the connection is reused; else
    `close`, which also tells llama-server to stop generating), or uses `async with`."""

    def __init__(self, response: aiohttp.ClientResponse, url: str) -> None:
        self.response = response
        self.url = url

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self.response.headers

    async def read(self) -> bytes:
        try:
            return await self.response.read()
        except TRANSPORT_ERRORS as e:
            raise unreachable(self.url, e, "broke its answer") from e

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except TRANSPORT_ERRORS as e:
            raise unreachable(self.url, e, "broke its answer") from e

    async def raise_error(self) -> NoReturn:
        """An error status: raise it as BackendError with the body as it came (read within ERROR_BODY_SECONDS).
        A body that breaks or stalls is BackendUnreachable: the request may go elsewhere."""
        try:
            async with asyncio.timeout(ERROR_BODY_SECONDS):
                raw = await self.read()
        except TimeoutError as e:
            self.close()
            raise unreachable(self.url, e, f"stalled its HTTP {self.status} answer") from e
        except BackendUnreachable:
            self.close()
            raise
        self.release()
        message, kind = error_message(self.status, raw)
        raise BackendError(message, status=self.status, type=kind or "backend_error", code=self.status, raw=raw,
                           content_type=self.headers.get("Content-Type"), server=self.headers.get("Server"))

    def release(self) -> None:
        self.response.release()

    def close(self) -> None:
        self.response.close()

    async def __aenter__(self) -> Upstream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class LlamaClient:
    """One llama-server. Shares the app's aiohttp session (one connection pool for all backends)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.short_timeout = aiohttp.ClientTimeout(total=min(timeout, ERROR_BODY_SECONDS))
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def chat(self, body: dict[str, Any], slot: int | None, path: str = CHAT_PATH,
                   client_auth: Mapping[str, str] | None = None) -> Upstream:
        """Send a chat request, pinned to `slot` when given. Returns the open answer (status 200): the caller reads
        it (JSON or SSE) and must release it. Another status raises BackendError with the backend's body; no answer
        (or one whose error body breaks) raises BackendUnreachable. Without LLAMA_API_KEY, the client's own
        credential (`client_auth`: its Authorization or X-Api-Key header) goes through, as it would to llama-server
        directly."""
        params = None
        if slot is not None:
            pin(body, slot)
            params = {"id_slot": str(slot)}
        auth = self.headers or dict(client_auth or {})
        try:
            data = orjson.dumps(body)
        except TypeError as e:  # orjson reads 1024 levels of nesting but writes only 254
            raise BadRequest(f"request body cannot be passed on: {e}", code="invalid_body") from e
        headers = {**auth, "Content-Type": "application/json"}
        if body.get("stream"):
            # llama-server (b11434) closes a streamed answer's connection after its last event although it answers
            # keep-alive: a request sent on it meanwhile would go out on a dead connection. Asked to close it, it
            # says so (it echoes `Connection: close`) and the pool never keeps it.
            headers["Connection"] = "close"
        upstream = await self._send("POST", path, params=params, data=data, headers=headers)
        if upstream.status != 200:
            await upstream.raise_error()
        return upstream

    async def slot_action(self, slot: int, action: str, filename: str | None = None,
                          model: str | None = None, timeout: float | None = None) -> SlotAction:
        """save, restore or erase. A failure is an answer (ok False), never an exception: a cache miss must only
        cost a prefill. `model`: on a router, the model whose slot it is (the router reads it from the body); a
        save there never loads a model the router has unloaded (`autoload=false`). `timeout`: seconds, else
        REQUEST_TIMEOUT (the server runs the action once the slot is idle)."""
        payload: dict[str, Any] = {"filename": filename} if filename is not None else {}
        params = {"action": action}
        if model is not None:
            payload["model"] = model
            if action == "save":
                params["autoload"] = "false"
        started = time.perf_counter()
        try:
            async with await self._send("POST", f"/slots/{slot}", params=params, data=orjson.dumps(payload),
                                        headers={**self.headers, "Content-Type": "application/json"},
                                        timeout=aiohttp.ClientTimeout(total=timeout) if timeout else None) as resp:
                raw = await resp.read()
                status = resp.status
        except BackendUnreachable as e:
            cause = e.__cause__ or e
            return SlotAction(False, 0, {"error": f"{type(cause).__name__}: {cause}"}, _ms(started))
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            doc = {"error": raw.decode("utf-8", "replace")[:500]}
        if not isinstance(doc, dict):
            doc = {"error": str(doc)[:500]}
        if status in (401, 403):
            log.warning("slot_action_refused url=%s action=%s status=%d: the server refused the API key",
                        self.url, action, status)
        return SlotAction(status == 200, status, doc, _ms(started))

    async def slots(self, model: str | None = None) -> list[dict[str, Any]] | None:
        """GET /slots (of one model's instance on a router, never loading it): one object per slot, or None when the
        server does not tell (no /slots endpoint, not a list). Raises BackendUnreachable, or BackendError (a router's
        unloaded model answers 400)."""
        path = "/slots" if model is None else f"/slots?{urlencode({'model': model, 'autoload': 'false'})}"
        listing = await self.get_json(path)
        if not isinstance(listing, list):
            return None
        return [s for s in listing if isinstance(s, dict)]

    async def props(self, model: str | None = None) -> dict[str, Any]:
        """GET /props (of one model's instance on a router, without loading it). Raises BackendUnreachable or
        BackendError."""
        path = "/props" if model is None else f"/props?{urlencode({'model': model, 'autoload': 'false'})}"
        props = await self.get_json(path)
        if not isinstance(props, dict):
            raise BackendError("/props is not a JSON object", status=502)
        return props

    async def get_json(self, path: str) -> Any:
        """GET a small JSON document (/props, /slots, /health). Raises BackendUnreachable or BackendError."""
        async with await self._send("GET", path, headers=self.headers, timeout=self.short_timeout) as resp:
            if resp.status != 200:
                await resp.raise_error()
            raw = await resp.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BackendError(f"{path} did not answer JSON but {body_text(raw) or 'nothing'}", status=502,
                               server=resp.headers.get("Server")) from e

    async def total_slots(self) -> int:
        props = await self.props()
        n = props.get("total_slots") if isinstance(props, dict) else None
        if not isinstance(n, int) or n < 1:
            raise BackendError("/props has no total_slots", status=502)
        return n

    async def forward(self, method: str, path_qs: str, headers: Mapping[str, str], body: bytes) -> Upstream:
        """Pass any other request through unchanged (hop-by-hop headers aside; the API key, when lpcache has one,
        replaces the client's)."""
        out = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
        if self.headers:
            out = {k: v for k, v in out.items() if k.lower() not in CREDENTIAL_HEADERS} | self.headers
        if b'"stream"' in body:
            out["Connection"] = "close"   # it may be streamed: not pooled (see `chat`)
        return await self._send(method, path_qs, data=body or None, headers=out, auto_decompress=False)

    async def _send(self, method: str, path: str, *, timeout: aiohttp.ClientTimeout | None = None,
                    **kwargs: Any) -> Upstream:
        """Send a request; the answer's headers are in. A pooled connection that breaks at once, before any answer
        (the server closed it: its keep-alive ran out just as it was taken, or the server was restarted and every
        pooled connection to it is dead) is no failure of the server: the request goes again at once, generations
        too, to the same slot, until it goes out on a connection the server opened for it (then a break is the
        server's: unreachable, the caller fails over). One that breaks later (STALE_BREAK_SECONDS) broke while the
        server worked on the request (it died, a balancer cut it): unreachable too, so a generation is never run
        once per pooled connection. Such connections are rare: lpcache keeps connections idle for less than
        llama-server's keep-alive, and closes a streamed answer's."""
        stale = 0
        while True:
            pooled = {"reused": False}
            sent = time.monotonic()
            try:
                response = await self.session.request(method, self.url + path, timeout=timeout or self.timeout,
                                                      allow_redirects=False, trace_request_ctx=pooled, **kwargs)
                return Upstream(response, self.url)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                at_once = time.monotonic() - sent < STALE_BREAK_SECONDS
                if pooled["reused"] and at_once and stale < STALE_RETRIES and \
                        not isinstance(e, aiohttp.ClientConnectorError):
                    stale += 1
                    log.info("stale_connection url=%s path=%s: a pooled connection was closed by the server; "
                             "sent again at once", self.url, path.split("?", 1)[0])
                    continue
                raise unreachable(self.url, e) from e
            except TRANSPORT_ERRORS as e:
                raise unreachable(self.url, e) from e


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0
