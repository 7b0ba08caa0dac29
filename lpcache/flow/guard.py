"""The gate: client keys (plain ASGI middleware, before any route), and the body's size limit and deadline (while
reading it).

All answer in OpenAI's error shape. Keys are compared in constant time and never logged; past the gate a client's
key is kept only as a digest (its identity: whose session, whose coalesced call or cached result).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from lpcache.apis import BY_PATH
from lpcache.backends import admission
from lpcache.backends.admission import Ticket
from lpcache.backends.llama import CREDENTIAL_HEADERS
from lpcache.cache import agent_ids
from lpcache.errors import ClientGoneReading, ProxyError

if TYPE_CHECKING:
    from lpcache.edge.browser_login import BrowserLogin

OPEN_PATHS = frozenset({"/health"})  # a load balancer's health check needs no key


# Where a client's key is, in the order llama-server reads them: Authorization, else X-Api-Key (Anthropic's clients).
_SECRET_HEADERS = frozenset({*CREDENTIAL_HEADERS, "proxy-authorization"})


def key_matches(given: bytes, keys: Sequence[bytes]) -> bool:
    """Whether `given` is one of the client keys, compared with every key in constant time, so the time taken does
    not tell which one nearly matched."""
    return any([hmac.compare_digest(given, k) for k in keys])


def credential(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """The client's credential header, (name, value), as llama-server picks it: Authorization, else X-Api-Key;
    None without either. `headers`: a request's (Starlette's `Headers`: names in any case, a repeated header's
    first value), or a dict with lower-case names."""
    for name in CREDENTIAL_HEADERS:
        value = headers.get(name)
        if value:
            return name, value
    return None


def presented_key(found: tuple[str, str] | None) -> str | None:
    """The key a credential shows, as llama-server reads it: the value, without a leading `Bearer ` (in any case,
    in either header)."""
    if found is None:
        return None
    value = found[1].strip()
    scheme, _, rest = value.partition(" ")
    key = rest.strip() if scheme.lower() == "bearer" else value
    return key or None


def digest(secret: str) -> str:
    """A secret as lpcache keeps it in memory keys and hands it to plugins: a SHA-256 digest, never the secret."""
    return hashlib.sha256(b"lpcache-client\x00" + secret.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def client_identity(headers: Mapping[str, str], keys_held: bool) -> str | None:
    """Who asks, as a digest: with client keys (`keys_held`), of the lpcache key the client showed; without, of the
    credential header as it goes on to llama-server (None without one). Two requests share an answer only when
    their identities are equal, so a request never gets an answer it would not have got alone."""
    found = credential(headers)
    if keys_held:
        key = presented_key(found)
        return digest(key) if key is not None else None
    if found is None:
        return None
    name, value = found
    return digest(f"{name}\x00{value}")


def passed_on(headers: Mapping[str, str], keys_held: bool) -> dict[str, str]:
    """The client's headers as they go on to llama-server: with client keys the credential is lpcache's own and
    stays here; without, it goes on as it came (llama-server checks it against its own --api-key)."""
    out: dict[str, str] = {}
    for k, v in headers.items():   # a repeated header: its first value, the one lpcache and llama-server read
        if not (keys_held and k.lower() in CREDENTIAL_HEADERS):
            out.setdefault(k, v)
    return out


def client_credential(headers: Mapping[str, str], keys_held: bool) -> dict[str, str]:
    """The credential header that goes on to llama-server with a generation request: none with client keys."""
    found = None if keys_held else credential(headers)
    return {} if found is None else {found[0]: found[1]}


def shown_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The request headers plugins see: without credentials (those count through `client_identity`)."""
    return {k: v for k, v in headers.items() if k.lower() not in _SECRET_HEADERS}


@dataclass(frozen=True)
class Caller:
    """Who asks, read once from a request's headers where it enters (`app`) and carried with it: the steps that
    need it (coalescing, the prefilters, session ownership, the call to llama-server) read these fields rather than
    the headers again, so they all see the same caller."""

    identity: str | None         # `client_identity`: answers are shared only between equal identities
    owner: str | None            # with client keys, the key's digest: whose sessions it may use and see
    credential: dict[str, str]   # `client_credential`: what goes on to llama-server with a generation request
    passed: dict[str, str]       # `passed_on`: the headers as they go on
    shown: dict[str, str]        # `shown_headers`: the headers plugins see
    session: str | None          # its session as the client named it (`agent_ids`: X-Session-ID, or an agent's)
    parents: tuple[str, ...] = ()   # a sub-agent's parent sessions, as named (seeding its first turn)
    session_source: str | None = None   # the header the session came from (`agent_ids.SOURCES`)
    ticket: Ticket = Ticket()   # its client and priority class in the line for a slot (`admission`)
    max_wait: float | None = None   # the longest it may wait for a slot, when it asks (X-Lpcache-Max-Wait)

    @classmethod
    def of(cls, headers: Mapping[str, str], keys_held: bool, agents: bool = True,
           classes: Mapping[str, int] | None = None, wait_limit: float | None = None) -> Caller:
        """`classes`: the priority class of each client key's identity (CLIENT_PRIORITIES); `wait_limit`:
        SLOT_WAIT_TIMEOUT, which X-Lpcache-Max-Wait may shorten."""
        identity = client_identity(headers, keys_held)
        named = agent_ids.from_headers(headers, agents)
        allowed = (classes or {}).get(identity or "", admission.NORMAL)
        ticket = Ticket(identity, admission.priority(headers.get(admission.PRIORITY_HEADER), allowed, keys_held))
        asked = headers.get(admission.MAX_WAIT_HEADER)
        return cls(identity, identity if keys_held else None, client_credential(headers, keys_held),
                   passed_on(headers, keys_held), shown_headers(headers), named.session if named else None,
                   named.parents if named else (), named.source if named else None, ticket,
                   admission.max_wait(asked, wait_limit) if asked is not None and wait_limit is not None else None)

    def named(self, api: str, body: Mapping[str, Any], agents: bool) -> tuple[str | None, tuple[str, ...], str]:
        """(session, parents, source) as the client named them: from its headers, or on a Messages request without
        a session header, Claude Code's `metadata.user_id` (`agent_ids.from_metadata`)."""
        if self.session is None and api == "messages" and agents:
            named = agent_ids.from_metadata(body)
            if named is not None:
                return named.session, named.parents, named.source
        return self.session, self.parents, self.session_source or "x-session-id"


async def send_error(send: Send, err: ProxyError, extra: Sequence[tuple[bytes, bytes]] = (),
                     payload: tuple[bytes, str] | None = None) -> int:
    """Send `err` on a raw ASGI channel (OpenAI's shape, or `payload`: the API's; a backend's error as it came);
    returns the body's size."""
    body, content_type = payload or err.payload()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", content_type.encode("latin-1", "replace")),
        (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return len(body)


class ApiKeys:
    """401 for a request without a configured key, shown as `Authorization: Bearer <key>` or, without an
    Authorization header, as `X-Api-Key: <key>` (Anthropic's clients); GET /health excepted. With `login`, the
    pages it knows take its cookie instead, and ask a browser without one for a key (`browser_login`)."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], login: BrowserLogin | None = None) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.login = login   # a browser's way in to the pages plugins name: a login form and its cookie

    def allowed(self, scope: Scope) -> bool:
        """The first credential header decides, as the rest of lpcache reads it (`client_identity`: whose session,
        whose coalesced call), so no request passes with a key that is not its identity."""
        key = presented_key(credential(Headers(scope=scope)))
        return key is not None and key_matches(key.encode("latin-1", "replace"), self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.allowed(scope) or (
                self.login is not None and self.login.admits(scope)):
            await self.app(scope, receive, send)
            return
        if self.login is not None and await self.login.serve(scope, receive, send):
            return
        err = ProxyError("invalid or missing API key (Authorization: Bearer <key>, or X-Api-Key: <key>)", status=401,
                         type="authentication_error", code="invalid_api_key")
        api = BY_PATH.get(scope["path"])   # in the shape the route's clients read (Anthropic's on /v1/messages)
        await send_error(send, err, [(b"www-authenticate", b"Bearer")], api.error(err) if api else None)


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
