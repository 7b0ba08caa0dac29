"""With client keys (LPCACHE_API_KEYS), how a browser gets into the pages plugins serve (the dashboard): a browser
cannot send an `Authorization` header, so the page asks for a key with a form, or takes it once in its URL
(`?key=`), and answers with a cookie and a redirect to the page without the key. The key gate (`guard.ApiKeys`)
takes that cookie instead of the header, on the paths the plugin named (`Routes.browser_paths()`) and no other.

The cookie holds no key: `v1.<issued, unix seconds>.<HMAC-SHA256 of the page and the issue time, keyed by the client
key>`, checked against every configured key in constant time; it lasts COOKIE_SECS, is HttpOnly, SameSite=Strict,
scoped to the page's path, and Secure over https. A key taken out of LPCACHE_API_KEYS takes its cookies with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import logging
import re
import time
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs

from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import Receive, Scope, Send

from lpcache.flow.guard import key_matches

log = logging.getLogger("lpcache.login")

COOKIE = "lpcache_login"
COOKIE_SECS = 7 * 86400
MAX_FORM_BYTES = 4096        # a login form's body; more is not read
FORM_TIMEOUT = 10.0          # seconds for it to come
_CLOCK_SKEW = 60             # a cookie issued up to this far in the future (another replica's clock) is fine
_ISSUED = re.compile(r"[0-9]{1,12}")   # the cookie's issue time: at most 12 ASCII digits


class BrowserLogin:
    """The login form, the key in the URL, and the cookie they give, for the pages in `pages` (each a list of
    paths: the page, then what it fetches)."""

    def __init__(self, keys: Sequence[str], pages: Sequence[Sequence[str]],
                 clock: Callable[[], float] = time.time) -> None:
        if not keys:
            raise ValueError("BrowserLogin needs at least one key")
        self.keys = [k.encode() for k in keys]
        self.clock = clock
        self.pages = {paths[0] for paths in pages if paths}
        self.opens = {path: paths[0] for paths in pages for path in paths}   # a path -> the page whose cookie opens it

    # ---- the cookie ----

    def cookie(self, key: bytes, page: str, issued: int) -> str:
        mac = hmac.new(key, b"lpcache-browser-login\x00%s\x00%d" % (page.encode(), issued), hashlib.sha256)
        return f"v1.{issued}.{mac.hexdigest()}"

    def valid(self, value: str, page: str) -> bool:
        version, _, rest = value.partition(".")
        issued_text, _, _mac = rest.partition(".")
        if version != "v1" or not _ISSUED.fullmatch(issued_text):   # ASCII digits only: "²".isdigit() is True
            return False
        issued, now = int(issued_text), self.clock()
        if not now - COOKIE_SECS <= issued <= now + _CLOCK_SKEW:
            return False
        given = value.encode("latin-1", "replace")
        # every key, so the time taken does not tell which one nearly matched
        return any([hmac.compare_digest(self.cookie(k, page, issued).encode(), given) for k in self.keys])

    def admits(self, scope: Scope) -> bool:
        """Whether the request reads (GET, HEAD) the page its path belongs to, or its stats, with a valid login
        cookie: the cookie opens nothing else (a POST to those paths would fall through to the backend)."""
        page = self.opens.get(scope["path"])
        if page is None or scope.get("method") not in ("GET", "HEAD"):
            return False
        value = cookie_parser(Headers(scope=scope).get("cookie", "")).get(COOKIE)
        return value is not None and self.valid(value, page)

    def key_ok(self, key: str) -> bool:
        return key_matches(key.encode("utf-8", "replace"), self.keys)

    # ---- the page's answers ----

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer a request for a page without a valid key or cookie: the form (401), or, with a right key (in
        the form or `?key=`), the cookie and a redirect to the page. False when it is not for a page (the gate then
        gives its JSON 401)."""
        page = scope["path"]
        if page not in self.pages or scope["method"] not in ("GET", "POST"):
            return False
        headers = Headers(scope=scope)
        key: str | None = None
        message = ""
        if scope["method"] == "GET":
            key = _first(parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key"))
            via = "url"
        else:
            via = "form"
            if headers.get("sec-fetch-site") == "cross-site":
                message = "A sign-in from another site is refused: open this page and sign in here."
            elif headers.get("content-type", "").split(";")[0].strip().lower() == "application/x-www-form-urlencoded":
                body = await _read_form(receive)
                key = _first(parse_qs(body.decode("utf-8", "replace")).get("key")) if body is not None else None
        if key is not None:
            ok = self.key_ok(key)
            log.info("browser_login page=%s via=%s ok=%s", page, via, ok)
            if ok:
                await self._let_in(scope, send, page, key)
                return True
            message = "That key is not one of this lpcache's client keys (LPCACHE_API_KEYS)."
        await _send(send, 401, _form(page, message), [(b"content-type", b"text/html; charset=utf-8"),
                                                      (b"content-security-policy", FORM_CSP.encode()),
                                                      (b"www-authenticate", b"Bearer")])
        return True

    async def _let_in(self, scope: Scope, send: Send, page: str, key: str) -> None:
        value = self.cookie(key.encode("utf-8", "replace"), page, int(self.clock()))
        https = scope.get("scheme") == "https" or Headers(scope=scope).get("x-forwarded-proto") == "https"
        cookie = f"{COOKIE}={value}; Path={page}; Max-Age={COOKIE_SECS}; HttpOnly; SameSite=Strict"
        # relative, as the page's own URLs are: the key is gone from the address bar and the history
        await _send(send, 303, b"", [(b"location", page.rsplit("/", 1)[1].encode()),
                                     (b"set-cookie", (cookie + ("; Secure" if https else "")).encode())])


FORM_CSP = ("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; "
            "frame-ancestors 'none'")

_FORM = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>lpcache: sign in</title>
<style>
:root { --bg: #f5f6f8; --panel: #fff; --text: #1c2330; --muted: #667085; --line: #e3e6ec; --accent: #2f6fde;
  --bad: #d9434d; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #12151b; --panel: #1b1f27; --text: #e6e9ef; --muted: #98a2b3; --line: #2b313c; --accent: #5b93f5;
    --bad: #f26b73; }
}
body { margin: 0; min-height: 100vh; display: grid; place-items: center; background: var(--bg); color: var(--text);
  font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
form { background: var(--panel); border: 1px solid var(--line); border-radius: 10px; padding: 22px 24px;
  width: min(380px, 92vw); }
h1 { font-size: 17px; margin: 0 0 6px; }
p { color: var(--muted); margin: 0 0 14px; }
p.bad { color: var(--bad); }
input, button { font: inherit; width: 100%; box-sizing: border-box; border-radius: 6px; padding: 7px 10px; }
input { color: var(--text); background: var(--bg); border: 1px solid var(--line); margin-bottom: 12px; }
button { border: 0; background: var(--accent); color: #fff; font-weight: 600; cursor: pointer; }
</style>
</head>
<body>
<form id="login" method="post" action="{action}">
  <h1>lpcache</h1>
  <p>This lpcache asks for a client key (one of LPCACHE_API_KEYS). It is checked once; the browser then keeps a
    cookie for this page, not the key.</p>
  {message}
  <label for="key" hidden>Client key</label>
  <input id="key" name="key" type="password" autocomplete="current-password" placeholder="client key" required
    autofocus>
  <button id="sign-in" type="submit">Sign in</button>
</form>
</body>
</html>
"""


def _form(page: str, message: str) -> bytes:
    shown = f'<p class="bad" id="login-error">{html.escape(message)}</p>' if message else ""
    action = html.escape(page.rsplit("/", 1)[1])
    return _FORM.replace("{action}", action).replace("{message}", shown).encode()


def _first(values: list[str] | None) -> str | None:
    return values[0] if values else None


async def _read_form(receive: Receive) -> bytes | None:
    """The body of a login form; None when it is too large or too slow."""
    chunks: list[bytes] = []
    seen = 0
    try:
        async with asyncio.timeout(FORM_TIMEOUT):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > MAX_FORM_BYTES:
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        return None


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        *headers, (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store"),
        (b"referrer-policy", b"no-referrer"), (b"x-content-type-options", b"nosniff")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
