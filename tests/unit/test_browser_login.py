"""A browser past client keys: the login form at a plugin's page, the key in the form or once in the URL, the
cookie that takes its place (no key in it, checked in constant time, only on the paths the plugin named, for a
limited time, gone with its key)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from lpcache.edge.browser_login import COOKIE, COOKIE_SECS, BrowserLogin
from lpcache.flow.guard import ApiKeys

KEYS = ["k-alpha-1234", "k-beta-5678"]
PAGE, STATS = "/ops/dash", "/ops/dash/api/stats"
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def ok(request: Any) -> PlainTextResponse:
    return PlainTextResponse("inside " + request.url.path)


def app(clock: Clock, keys: list[str] = KEYS, pages: list[list[str]] | None = None) -> Starlette:
    routes = [Route(p, ok) for p in (PAGE, STATS, "/other/page", "/v1/models", "/metrics")]
    built = Starlette(routes=routes)
    login = BrowserLogin(keys, pages if pages is not None else [[PAGE, STATS]], clock=clock)
    built.add_middleware(ApiKeys, keys=keys, login=login)
    return built


def client(clock: Clock, **kwargs: Any) -> httpx.AsyncClient:
    """A client that keeps no cookie: every cookie a test sends, it sends by hand."""
    async def forget(response: httpx.Response) -> None:
        http.cookies.clear()

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app(clock, **kwargs)), base_url="http://test",
                             event_hooks={"response": [forget]})
    return http


def cookie_of(resp: httpx.Response) -> str:
    """The login cookie an answer sets (the tests send it by hand; `client` keeps no cookie jar)."""
    header = resp.headers["set-cookie"]
    match = re.match(rf"{COOKIE}=([^;]+)", header)
    assert match, header
    return match.group(1)


async def test_a_page_without_a_key_shows_the_form_and_its_data_stays_closed() -> None:
    async with client(Clock()) as http:
        page = await http.get(PAGE)
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert page.headers["www-authenticate"] == "Bearer" and page.headers["cache-control"] == "no-store"
        assert "form-action 'self'" in page.headers["content-security-policy"]
        assert '<form id="login" method="post" action="dash">' in page.text and 'name="key"' in page.text
        assert 'type="password"' in page.text and "set-cookie" not in page.headers
        stats = await http.get(STATS)
        assert stats.status_code == 401 and stats.json()["error"]["code"] == "invalid_api_key"


async def test_the_form_lets_a_right_key_in_with_a_cookie() -> None:
    async with client(Clock()) as http:
        wrong = await http.post(PAGE, data={"key": "nope"})
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        assert 'id="login-error"' in wrong.text and "nope" not in wrong.text
        resp = await http.post(PAGE, data={"key": KEYS[1]})
        assert resp.status_code == 303 and resp.headers["location"] == "dash"   # relative: /ops/dash
        header = resp.headers["set-cookie"]
        for part in ("HttpOnly", "SameSite=Strict", f"Path={PAGE}", f"Max-Age={COOKIE_SECS}"):
            assert part in header, header
        assert "Secure" not in header                      # plain http: a Secure cookie would never come back
        value = cookie_of(resp)
        assert KEYS[1] not in header and value.startswith("v1.")
        with_cookie = {"cookie": f"{COOKIE}={value}"}
        assert (await http.get(PAGE, headers=with_cookie)).text == "inside " + PAGE
        assert (await http.get(STATS, headers=with_cookie)).text == "inside " + STATS
        for other in ("/v1/models", "/metrics", "/other/page"):   # the cookie opens the dashboard only
            assert (await http.get(other, headers=with_cookie)).status_code == 401, other
        assert (await http.post(STATS, headers=with_cookie)).status_code == 401   # for reading only


async def test_a_key_in_the_url_is_exchanged_for_the_cookie() -> None:
    async with client(Clock()) as http:
        resp = await http.get(PAGE, params={"key": KEYS[0]})
        assert resp.status_code == 303 and resp.headers["location"] == "dash" and "key" not in resp.headers[
            "location"]
        assert (await http.get(STATS, headers={"cookie": f"{COOKIE}={cookie_of(resp)}"})).status_code == 200
        wrong = await http.get(PAGE, params={"key": "k-alpha-123"})
        assert wrong.status_code == 401 and 'id="login-error"' in wrong.text
        assert (await http.get(STATS, params={"key": KEYS[0]})).status_code == 401   # only the page takes it


async def test_the_header_still_works_as_before() -> None:
    async with client(Clock()) as http:
        auth = {"authorization": f"Bearer {KEYS[0]}"}
        assert (await http.get(STATS, headers=auth)).status_code == 200
        assert (await http.get("/v1/models", headers=auth)).status_code == 200


async def test_a_cookie_that_is_old_tampered_or_of_a_removed_key_is_refused() -> None:
    clock = Clock()
    async with client(clock) as http:
        value = cookie_of(await http.post(PAGE, data={"key": KEYS[0]}))
        version, issued, mac = value.split(".")
        bad = [f"{version}.{int(issued) - 10}.{mac}",              # another issue time, same MAC
               f"{version}.{issued}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}",
               f"v2.{issued}.{mac}", "v1..", "v1.x.y", "", "v1." + "9" * 40 + ".00", KEYS[0]]
        for cookie in bad:
            assert (await http.get(STATS, headers={"cookie": f"{COOKIE}={cookie}"})).status_code == 401, cookie
        clock.now += COOKIE_SECS - 5
        assert (await http.get(STATS, headers={"cookie": f"{COOKIE}={value}"})).status_code == 200
        clock.now += 10
        assert (await http.get(STATS, headers={"cookie": f"{COOKIE}={value}"})).status_code == 401
    clock = Clock()
    async with client(clock) as http:
        value = cookie_of(await http.post(PAGE, data={"key": KEYS[0]}))
    async with client(clock, keys=[KEYS[1]]) as http:              # lpcache restarted without that key
        assert (await http.get(STATS, headers={"cookie": f"{COOKIE}={value}"})).status_code == 401


async def test_a_cookie_opens_its_own_page_only() -> None:
    clock = Clock()
    pages = [[PAGE, STATS], ["/other/page"]]
    async with client(clock, pages=pages) as http:
        value = cookie_of(await http.post(PAGE, data={"key": KEYS[0]}))
        assert (await http.get("/other/page", headers={"cookie": f"{COOKIE}={value}"})).status_code == 401
        other = cookie_of(await http.post("/other/page", data={"key": KEYS[0]}))
        assert (await http.get("/other/page", headers={"cookie": f"{COOKIE}={other}"})).status_code == 200


@pytest.mark.parametrize(("headers", "body"), [
    ({"sec-fetch-site": "cross-site", "content-type": "application/x-www-form-urlencoded"}, f"key={KEYS[0]}"),
    ({"content-type": "application/json"}, f'{{"key": "{KEYS[0]}"}}'),
    ({"content-type": "application/x-www-form-urlencoded"}, f"key={KEYS[0]}&pad=" + "x" * 5000),
])
async def test_a_form_from_elsewhere_or_of_another_shape_does_not_sign_in(headers: dict[str, str],
                                                                         body: str) -> None:
    async with client(Clock()) as http:
        resp = await http.post(PAGE, content=body.encode(), headers=headers)
        assert resp.status_code == 401 and "set-cookie" not in resp.headers


async def test_over_https_the_cookie_is_secure() -> None:
    async with client(Clock()) as http:
        resp = await http.post(PAGE, data={"key": KEYS[0]}, headers={"x-forwarded-proto": "https"})
        assert resp.status_code == 303 and "; Secure" in resp.headers["set-cookie"]
    transport = httpx.ASGITransport(app=app(Clock()))
    async with httpx.AsyncClient(transport=transport, base_url="https://test") as http:
        assert "; Secure" in (await http.post(PAGE, data={"key": KEYS[0]})).headers["set-cookie"]


def test_the_cookie_is_an_hmac_not_the_key() -> None:
    login = BrowserLogin(KEYS, [[PAGE, STATS]], clock=Clock())
    a = login.cookie(KEYS[0].encode(), PAGE, int(T0))
    assert KEYS[0] not in a and a != login.cookie(KEYS[1].encode(), PAGE, int(T0))
    assert a != login.cookie(KEYS[0].encode(), "/elsewhere", int(T0))
    assert login.valid(a, PAGE) and not login.valid(a, "/elsewhere")
    with pytest.raises(ValueError):
        BrowserLogin([], [[PAGE]])


async def test_a_cookie_of_digits_that_are_not_ascii_is_refused_not_a_crash() -> None:
    """'²'.isdigit() is True and int('²') raises: the issue time must be ASCII digits (a 401, never a 500)."""
    clock = Clock()
    async with client(clock) as http:
        for raw in (b"v1.\xb2.abc", b"v1.1\xb9\xb3.abc", "v1.١٢٣.abc".encode()):
            resp = await http.get(STATS, headers={"cookie": b"lpcache_login=" + raw})
            assert resp.status_code == 401, raw


async def test_the_cookie_opens_the_page_for_reading_only() -> None:
    clock = Clock()
    async with client(clock) as http:
        value = cookie_of(await http.post(PAGE, data={"key": KEYS[0]}))
        assert (await http.get(STATS, headers={"cookie": f"{COOKIE}={value}"})).status_code == 200
        assert (await http.head(STATS, headers={"cookie": f"{COOKIE}={value}"})).status_code in (200, 405)
        for method in ("POST", "PUT", "DELETE"):
            resp = await http.request(method, STATS, headers={"cookie": f"{COOKIE}={value}"})
            assert resp.status_code == 401, method
