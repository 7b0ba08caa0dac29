"""The HTTP edge against the stand-in and raw sockets: a big body does not stall other streams, request heads and
bodies are bounded in size and time, every refusal is OpenAI-shaped JSON, a client that leaves while sending its
body leaves a record and no traceback, and with client keys each key sees and uses only its own sessions."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Any

import orjson
import pytest

from lpcache.apis import BY_PATH
from lpcache.apis.base import OFF_LOOP_BYTES
from lpcache.edge.http import MAX_HEAD_BYTES, MAX_HEADERS
from lpcache.workloads import chats

from ..conftest import figures, user, words

S1 = "1" * 32


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection (or the deadline passes: then fail)."""
    got = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the connection was still open at the deadline (got {got[:200]!r})")


def status_and_json(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(body)


# ---- a big body is parsed off the event loop ----

def big_body(min_bytes: int) -> bytes:
    """A realistic chat body (chats.py's mix of prose, code, Unicode) of at least `min_bytes`."""
    base = chats.request(5, 3000, chats.harness(2), turns=3)["messages"]
    messages: list[Any] = []
    while len(orjson.dumps(messages)) < min_bytes:
        messages += [{**m, "content": f"{len(messages)} {m['content']}"} if isinstance(m.get("content"), str) else m
                     for m in base]
    messages.append({"role": "user", "content": "now say forbidden-word-xyz"})
    return orjson.dumps({"messages": messages})


def test_a_big_body_does_not_stall_a_concurrent_stream(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=2.0, slots=2)
    # The keyword prefilter answers the big request once parsed, so the stand-in (in this process, on its own loop)
    # never parses it: only lpcache's handling of the body is measured.
    proxy = start_proxy(backend, plugins=({"name": "keyword", "params": {"keywords": ["forbidden-word-xyz"]}},))
    raw = big_body(8 * 1024 * 1024)
    t = time.perf_counter()
    BY_PATH["/v1/chat/completions"].parse(raw, "/v1/chat/completions", proxy.settings)
    parse_s = time.perf_counter() - t
    assert len(raw) > OFF_LOOP_BYTES

    arrivals: list[float] = []
    first, stop = threading.Event(), threading.Event()

    def stream() -> None:
        with proxy.client.stream("POST", "/v1/chat/completions",
                                 json={"messages": user(words(1, 20)), "stream": True, "max_tokens": 100000}) as r:
            for _ in r.iter_raw():
                arrivals.append(time.monotonic())
                first.set()
                if stop.is_set():
                    return

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(20), "the stream did not start"
    t0 = time.monotonic()
    r = proxy.client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    t1 = time.monotonic()
    stop.set()
    reader.join(20)
    assert r.status_code == 400 and r.json()["error"]["code"] is not None    # parsed, then refused by the keyword
    during = [a for a in arrivals if t0 <= a <= t1]
    bounds = [max((a for a in arrivals if a < t0), default=t0), *during,
              min((a for a in arrivals if a > t1), default=t1)]
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    assert len(during) > 5, f"no stream chunk while the big body ({len(raw)} bytes) was handled"
    figures(f"big body {len(raw) / 2**20:.1f} MiB: parse {parse_s:.2f} s, answered in {t1 - t0:.2f} s, longest gap of "
            f"a concurrent stream {longest * 1000:.0f} ms")
    assert longest < parse_s / 3, f"longest stream gap {longest:.3f} s, parsing alone takes {parse_s:.3f} s"


# ---- request heads: size, count, deadline ----

def flood(url: str, start: bytes, chunk: bytes, most: int) -> tuple[int, bytes]:
    """Send `start`, then `chunk` again and again (at most `most` bytes) until lpcache answers or closes: the bytes
    of `chunk` it took in meanwhile, and its answer."""
    sock = connect(url)
    sock.sendall(start)
    sent = 0
    deadline = time.monotonic() + 20
    with sock:
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable and sent < most:
                try:
                    sent += sock.send(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
        return sent, read_until_closed(sock, time.monotonic() + 10)


def test_a_huge_header_is_refused_without_being_read(proxy: Any) -> None:
    sent, answer = flood(proxy.url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * 65536, 16 * 1024 * 1024)
    status, doc = status_and_json(answer)
    assert status == 431 and doc["error"]["code"] == "request_header_too_large"
    assert sent < 4 * 1024 * 1024, f"{sent} bytes of header were taken in before the answer"
    assert MAX_HEAD_BYTES < 1024 * 1024


def test_too_many_headers_get_431(proxy: Any) -> None:
    headers = {f"x-h{i}": "v" for i in range(MAX_HEADERS + 1)}
    r = proxy.client.get("/v1/models", headers=headers)
    assert r.status_code == 431 and r.json()["error"]["code"] == "too_many_headers"
    many = "".join(f"x{i}: v\r\n" for i in range(20000)).encode()
    sock = connect(proxy.url)
    with sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _ = status_and_json(read_until_closed(sock, time.monotonic() + 10))
    assert status == 431


def test_a_flood_of_chunked_trailer_fields_gets_431_before_much_is_read(proxy: Any) -> None:
    """The trailer fields after a chunked body's last chunk are a head of their own, bounded like the request's
    (an HTTP parser that does not bound them lets a client grow the process's memory at the wire's speed)."""
    sent, answer = flood(proxy.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n", b"a:b\r\n" * 13000,
                         64 * 1024 * 1024)
    status, doc = status_and_json(answer)
    assert status == 431 and doc["error"]["code"] == "request_header_too_large"
    assert sent < 4 * 1024 * 1024, f"{sent} bytes of trailer fields were taken in before the answer"


def test_a_request_asking_for_h2c_is_served_over_http_1_1_with_its_body(proxy: Any) -> None:
    """curl --http2 and Java's HttpClient offer `Upgrade: h2c` on plain http: the request is served as HTTP/1.1,
    its body read (a parser that takes the offer for the end of HTTP on the connection loses the body)."""
    body = orjson.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
    sock = connect(proxy.url)
    with sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings, close"
                     b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        status, doc = status_and_json(read_until_closed(sock, time.monotonic() + 20))
    assert status == 200, doc
    assert doc["choices"][0]["message"]["role"] == "assistant"


def test_a_slow_head_is_cut_off(start_proxy: Any, backend: Any) -> None:
    proxy = start_proxy(backend, client_timeout=0.5)
    sock = connect(proxy.url)
    started = time.monotonic()
    with sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        # slowloris: a header line now and then, never the end of the head
        deadline = started + 10
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sock], [], [], 0.1)
            if ready:
                break
            try:
                sock.sendall(b"X-a: b\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = read_until_closed(sock, deadline)
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 5, elapsed   # the deadline runs from the accept, a little before `started`
    status, doc = status_and_json(answer)
    assert status == 408 and doc["error"]["code"] == "request_timeout"


def test_a_silent_connection_is_closed(start_proxy: Any, backend: Any) -> None:
    proxy = start_proxy(backend, client_timeout=0.5)
    sock = connect(proxy.url)
    with sock:
        answer = read_until_closed(sock, time.monotonic() + 10)
    assert status_and_json(answer)[0] == 408


def test_a_slow_body_gets_408_and_a_record(start_proxy: Any, backend: Any) -> None:
    proxy = start_proxy(backend, client_timeout=0.5)
    sock = connect(proxy.url)
    with sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": ")
        answer = read_until_closed(sock, time.monotonic() + 10)
    status, doc = status_and_json(answer)
    assert status == 408 and doc["error"]["code"] == "request_timeout"
    proxy.wait_finished(1)
    assert (proxy.records[-1].status, proxy.records[-1].reason) == (408, "client_timeout")
    assert proxy.busy_slots() == []


# ---- every refusal in OpenAI's shape ----

@pytest.mark.parametrize("method", ["TRACE", "PROPFIND", "CONNECT"])
def test_an_unknown_method_gets_a_json_405(proxy: Any, method: str) -> None:
    r = proxy.client.request(method, "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.headers["allow"]


def test_a_malformed_request_line_gets_a_json_400(proxy: Any) -> None:
    sock = connect(proxy.url)
    with sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, doc = status_and_json(read_until_closed(sock, time.monotonic() + 10))
    assert status == 400 and doc["error"]["code"] == "invalid_http_request"


# ---- a client that leaves while sending its body ----

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_gone_during_the_body_leaves_a_record_and_no_traceback(
        proxy: Any, path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    sock = connect(proxy.url)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100000\r\n\r\n".encode() + b'{"messages": [')
    sock.close()
    proxy.wait_finished(1)
    record = proxy.records[-1]
    assert (record.status, record.reason, record.path) == (499, "client_disconnected", path)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    assert any("request_done status=499" in r.getMessage() for r in caplog.records)
    assert proxy.busy_slots() == []


# ---- sessions belong to the client key that made them ----

def test_each_client_key_sees_and_uses_only_its_own_sessions(start_proxy: Any, start_backend: Any,
                                                              slot_dir: str) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend, api_keys=("key-a", "key-b"))
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    text = words(1, 200)
    assert proxy.push(user(text), {**a, "X-Session-ID": S1}).status_code == 200
    listing_a = proxy.client.get("/lpcache/sessions", headers=a).json()["data"]
    assert [s["session"] for s in listing_a] == [S1]
    assert proxy.client.get("/lpcache/sessions", headers=b).json()["data"] == []          # list
    assert proxy.client.get(f"/lpcache/sessions/{S1}/compare", headers=b).json()["error"]["code"] == \
        "session_not_found"                                                               # compare

    # b sends a's session id: a session of its own, in a file of its own (no restore of a's, no overwrite)
    r = proxy.push(user(text + " and more"), {**b, "X-Session-ID": S1})
    assert r.status_code == 200 and r.headers["x-lpcache-restored"] == "false"           # probe
    listing_b = proxy.client.get("/lpcache/sessions", headers=b).json()["data"]
    assert [s["session"] for s in listing_b] == [S1] and listing_b[0]["file"] != listing_a[0]["file"]
    assert sorted(os.listdir(slot_dir)) == sorted([listing_a[0]["file"], listing_b[0]["file"]])

    proxy.push(user(text + " then"), {**a, "X-Session-ID": S1})
    mine = proxy.client.get(f"/lpcache/sessions/{S1}/compare", headers=a).json()
    assert mine["requests"] == 2 and mine["file"] == listing_a[0]["file"]   # b's request is not in a's history
    assert proxy.records[-1].restored is True                                # a's own file, untouched by b


def test_without_client_keys_every_client_sees_every_session(start_proxy: Any, start_backend: Any) -> None:
    proxy = start_proxy(start_backend(slots=1))
    proxy.push(user(words(1, 200)), {"X-Session-ID": S1, "Authorization": "Bearer anything"})
    assert [s["session"] for s in proxy.client.get("/lpcache/sessions").json()["data"]] == [S1]


def test_a_key_counts_only_in_the_authorization_header_lpcache_reads(start_proxy: Any, start_backend: Any) -> None:
    """Two Authorization headers, the first not a bearer key: the gate reads the same (first) one as everything
    past it (whose session, whose coalesced call), so no client passes the gate with an identity of nobody."""
    proxy = start_proxy(start_backend(slots=1), api_keys=("key-a",))
    two = [("Authorization", "Basic eDp5"), ("Authorization", "Bearer key-a")]
    r = proxy.client.post("/v1/chat/completions", json={"messages": user("hi")}, headers=two)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert proxy.client.get("/lpcache/sessions", headers=two).status_code == 401
    ok = [("Authorization", "Bearer key-a"), ("Authorization", "Basic eDp5")]
    assert proxy.client.get("/lpcache/sessions", headers=ok).status_code == 200
