"""Refusals before a wait, against the stand-in: 429 past QUEUE_MAX, 503 when the predicted wait passes the
request's deadline, both with Retry-After, in each API's error shape, never a slot left taken."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from lpcache.backends.admission import HOLD_TRUSTED

from ..conftest import user, words
from .conftest import until

SLOW = {"gen_ms_per_token": 20.0}   # an answer of 10 tokens holds its slot about 0.2 s


def busy_with(proxy: Any, n: int) -> list[threading.Thread]:
    """n requests sent at once (one runs, the others wait in line), returned once they all are in."""
    def send(i: int) -> None:
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                       json={"messages": user(words(100 + i, 30)), "max_tokens": 10})
        assert r.status_code == 200, r.text
    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    until(lambda: sum(s.busy for s in proxy.pipeline.pool.slots) == 1 and proxy.pipeline.pool.waiting == n - 1)
    return threads


def test_a_full_line_refuses_with_429_and_retry_after(start_proxy: Any, start_backend: Any) -> None:
    backend = start_backend(slots=1, **SLOW)
    proxy = start_proxy(backend, queue_max=2)
    threads = busy_with(proxy, 3)
    r = proxy.chat(user("Ça va ? 你好"), max_tokens=4)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
    m = proxy.client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": user("hello there")})
    assert m.status_code == 429 and m.json()["type"] == "error" and "retry-after" in m.headers
    for t in threads:
        t.join()
    until(lambda: not any(s.busy for s in proxy.pipeline.pool.slots))
    assert proxy.chat(user("and now?"), max_tokens=4).status_code == 200
    assert 'lpcache_queue_refused_total{reason="queue_full"} 2.0' in proxy.client.get("/metrics").text


def test_a_wait_past_the_deadline_is_refused_at_once(start_proxy: Any, start_backend: Any) -> None:
    backend = start_backend(slots=1, **SLOW)
    proxy = start_proxy(backend)
    for i in range(HOLD_TRUSTED):   # the slot's hold times, learnt
        assert proxy.chat(user(words(i, 20)), max_tokens=10).status_code == 200
    threads = busy_with(proxy, 3)
    started = time.monotonic()
    r = proxy.chat(user(words(50, 20)), {"X-Lpcache-Max-Wait": "0.05"}, max_tokens=4)
    assert time.monotonic() - started < 0.5
    assert r.status_code == 503 and r.json()["error"]["code"] == "wait_past_deadline"
    assert int(r.headers["retry-after"]) >= 1
    assert proxy.records[-1].reason == "wait_past_deadline"
    # a request allowed to wait long enough waits its turn and is served
    assert proxy.chat(user(words(51, 20)), {"X-Lpcache-Max-Wait": "30"}, max_tokens=4).status_code == 200
    for t in threads:
        t.join()
    until(lambda: not any(s.busy for s in proxy.pipeline.pool.slots))   # the last answer's save ends it
    assert proxy.pipeline.pool.waiting == 0
