"""Several stand-in backends: breakers, failover, recovery by probes, client keys, body limit."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from orjson import loads as orjson_loads

from lpcache.config import BackendConfig
from lpcache.mock_llama import MockConfig, start_mock
from lpcache.workloads.harness import free_port

from ..conftest import Proxy, user, words
from .conftest import mock_stats

SMALL = 20
BIG = 200


def fault(backend: Any, **faults: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json=faults).raise_for_status()


def wait_for(condition: Any, timeout: float = 20.0) -> None:
    """Poll a condition of lpcache's own state with a deadline (the prober works on its own clock)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def breaker(proxy: Proxy, index: int) -> str:
    return proxy.pipeline.backends[index].breaker.state


def test_a_backend_down_at_start_is_marked_and_the_other_serves(start_backend: Any, start_proxy: Any) -> None:
    good = start_backend()
    proxy = start_proxy(BackendConfig(f"http://127.0.0.1:{free_port()}", 2), good)
    assert breaker(proxy, 0) == "open"
    for i in range(6):
        r = proxy.chat(user(words(i, SMALL)))
        assert r.status_code == 200 and r.headers["x-lpcache-slot"].startswith("1:")
    health = proxy.client.get("/health")
    assert health.status_code == 200
    assert [b["state"] for b in health.json()["backends"]] == ["open", "closed"]


def test_health_is_503_only_when_no_backend_can_serve(start_proxy: Any) -> None:
    proxy = start_proxy(BackendConfig(f"http://127.0.0.1:{free_port()}", 1),
                        BackendConfig(f"http://127.0.0.1:{free_port()}", 1), breaker_cooldown_ms=60000)
    health = proxy.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 502 and r.json()["error"]["type"] == "backend_unreachable"
    assert proxy.busy_slots() == []


def test_dropped_connection_fails_over_to_the_other_backend(start_backend: Any, start_proxy: Any) -> None:
    a, b = start_backend(), start_backend()
    proxy = start_proxy(a, b)
    # a request dropped on a pooled connection is taken for one the server closed as idle, and sent again at once;
    # dropped on a connection opened for it, it is the backend's failure
    fault(a, drop=100)
    fault(b, drop=0)
    r = proxy.chat(user(words(1, SMALL)))   # the first idle slot is on a: dropped, then b
    assert r.status_code == 200 and r.headers["x-lpcache-slot"].startswith("1:")
    proxy.wait_finished(1)
    assert proxy.records[0].retries == 1
    assert breaker(proxy, 0) == "open"
    assert proxy.busy_slots() == []


def test_a_generation_whose_pooled_connection_drops_is_answered_by_its_slot(start_backend: Any,
                                                                             start_proxy: Any) -> None:
    """One slot, a pooled connection dropped before any answer (the server's keep-alive ran out, or it was
    restarted): the request goes again to the same slot, not failed over (here: a 502), the backend not blamed."""
    backend = start_backend(slots=1)
    proxy = start_proxy(backend)
    assert proxy.chat(user(words(1, SMALL))).status_code == 200   # its connection is pooled now
    fault(backend, drop=1)
    r = proxy.chat(user(words(2, SMALL)))
    assert r.status_code == 200 and r.headers["x-lpcache-slot"] == "0:0"
    proxy.wait_finished(2)
    assert proxy.records[1].retries == 0 and breaker(proxy, 0) == "closed"
    assert mock_stats(backend)["requests_by_path"]["/v1/chat/completions"] == 3
    assert proxy.busy_slots() == []


def test_a_stream_that_breaks_before_its_first_byte_fails_over(start_backend: Any, start_proxy: Any) -> None:
    a, b = start_backend(), start_backend()
    proxy = start_proxy(a, b)
    fault(a, stream_break_after=0, stream_break_count=1)
    with proxy.client.stream("POST", "/v1/chat/completions",
                             json={"messages": user(words(1, SMALL)), "stream": True, "max_tokens": 5}) as r:
        raw = r.read()
        assert r.headers["x-lpcache-slot"].startswith("1:")
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"\n\n") == 5 + 3
    proxy.wait_finished(1)
    assert proxy.records[0].retries == 1


def test_single_backend_failure_is_a_clean_502(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    proxy = start_proxy(backend)
    fault(backend, drop=100)
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 502 and r.json()["error"]["type"] == "backend_unreachable"
    proxy.wait_finished(1)
    assert proxy.records[0].retries == 2          # both slots tried
    assert proxy.busy_slots() == []


def test_5xx_opens_the_breaker_and_the_next_request_goes_elsewhere(start_backend: Any, start_proxy: Any) -> None:
    a, b = start_backend(), start_backend()
    proxy = start_proxy(a, b, breaker_cooldown_ms=60000)
    fault(a, status=500, status_count=1)
    first = proxy.chat(user(words(1, SMALL)))
    assert first.status_code == 500                # a backend's own error is passed on, not retried
    assert breaker(proxy, 0) == "open"
    for i in range(4):
        assert proxy.chat(user(words(i + 2, SMALL))).headers["x-lpcache-slot"].startswith("1:")


def test_cooldown_escalates_and_a_probe_closes_the_breaker(start_backend: Any, start_proxy: Any) -> None:
    port = free_port()
    good = start_backend()
    proxy = start_proxy(BackendConfig(f"http://127.0.0.1:{port}", 2), good, breaker_cooldown_ms=100)
    b0 = proxy.pipeline.backends[0]
    wait_for(lambda: b0.breaker.failures >= 3)     # the prober failed again after each cooldown
    assert b0.breaker.cooldown == pytest.approx(0.1 * 2 ** (b0.breaker.failures - 1), rel=0.01) or \
        b0.breaker.cooldown == 60.0
    revived = start_mock(MockConfig(port=port, slot_save_path=good.app_state.config.slot_save_path))
    try:
        wait_for(lambda: b0.breaker.state == "closed")
        assert b0.breaker.failures == 0
        seen = {proxy.chat(user(words(i, SMALL))).headers["x-lpcache-slot"][0] for i in range(6)}
        assert seen == {"0", "1"}                  # the revived backend serves again
    finally:
        revived.stop()


def test_backend_killed_mid_run_then_restarted(start_backend: Any, start_proxy: Any, slot_dir: str) -> None:
    """Two backends, one stopped in the middle of 500 requests at concurrency 16 (a quarter of them streamed): every
    request that had no byte sent to its client succeeds on the other backend; a stream cut after its first bytes
    ends with an error event. The killed backend is cooled down, and once restarted on its port it serves again,
    without restarting lpcache."""
    a, b = start_backend(gen_ms_per_token=1), start_backend(gen_ms_per_token=1)
    port = a.port
    proxy = start_proxy(a, b, breaker_cooldown_ms=100, breaker_max_cooldown_ms=400)
    done = 0

    def one(i: int) -> tuple[bool, int, bytes]:
        nonlocal done
        stream = i % 4 == 0
        r = proxy.client.post("/v1/chat/completions", json={"messages": user(words(i, SMALL)), "max_tokens": 4,
                                                            "stream": stream})
        done += 1
        return stream, r.status_code, r.content

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(500)]
        wait_for(lambda: done >= 150)
        a.stop()
        results = [f.result() for f in futures]
    for stream, status, content in results:
        assert status == 200
        if stream:
            assert content.endswith(b"data: [DONE]\n\n") or content.rstrip().split(b"\n\n")[-1].startswith(
                b'data: {"error"')
        else:
            assert orjson_loads(content)["choices"][0]["message"]["content"]
    cut = [c for s_, _, c in results if s_ and not c.endswith(b"data: [DONE]\n\n")]
    print(f"\n500 requests, backend killed after {150}+: {len(cut)} stream(s) cut after their first bytes")
    assert proxy.pipeline.backends[0].breaker.state != "closed"
    revived = start_mock(MockConfig(port=port, slot_save_path=slot_dir))
    try:
        wait_for(lambda: proxy.pipeline.backends[0].breaker.state == "closed")
        for i in range(8):
            assert proxy.chat(user(words(1000 + i, SMALL)), max_tokens=1).status_code == 200
        assert sum(mock_stats(revived)["chat_by_slot"].values()) >= 1
    finally:
        revived.stop()
    proxy.settle()
    assert proxy.busy_slots() == []


def test_three_backends_two_failing(start_backend: Any, start_proxy: Any) -> None:
    a, b, c = start_backend(), start_backend(), start_backend()
    proxy = start_proxy(a, b, c, breaker_cooldown_ms=60000)
    fault(a, drop=100)
    fault(b, status=503, status_count=-1)
    statuses = [proxy.chat(user(words(i, SMALL))).status_code for i in range(10)]
    # a drops connections: failover; b answers 503: passed on once, then its breaker keeps requests away
    assert statuses.count(503) == 1 and statuses.count(200) == 9
    assert [breaker(proxy, i) for i in range(3)] == ["open", "open", "closed"]
    assert mock_stats(c)["chat_requests"] == 9
    assert proxy.busy_slots() == []


def test_client_keys(start_backend: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = start_proxy(start_backend(), api_keys=("key-one", "key-two"))
    assert proxy.chat(user(words(1, SMALL))).status_code == 401
    bad = proxy.client.post("/v1/chat/completions", json={"messages": user("hi")},
                            headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    ok = proxy.client.post("/v1/chat/completions", json={"messages": user("hi")},
                           headers={"Authorization": "Bearer key-two"})
    assert ok.status_code == 200
    assert proxy.client.get("/v1/models").status_code == 401
    assert proxy.client.get("/tokenize").status_code == 401
    assert proxy.client.get("/health").status_code == 200
    assert "key-one" not in caplog.text and "key-two" not in caplog.text


def test_body_size_limit(proxy: Proxy, start_proxy: Any, backend: Any) -> None:
    small = start_proxy(backend, max_body_bytes=1000)
    big_body = {"messages": user(words(1, 400))}
    r = small.client.post("/v1/chat/completions", json=big_body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:
        for _ in range(20):
            yield b"x" * 100

    chunked = small.client.post("/v1/chat/completions", content=chunks(),
                                headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert small.client.post("/tokenize", content=b"x" * 2000).status_code == 413
    assert small.busy_slots() == [] and mock_stats(backend)["chat_requests"] == 0


def test_restores_go_only_to_kv_cache_backends_that_can_read_the_file(start_backend: Any, start_proxy: Any,
                                                                       tmp_path: Any) -> None:
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = start_backend(slots=1, slot_save_path=str(plain_dir))
    kv = start_backend(slots=1)
    proxy = start_proxy(BackendConfig(plain.url, 1, str(plain_dir), kv_cache=False),
                        BackendConfig(kv.url, 1, kv.app_state.config.slot_save_path))
    y = words(2, BIG)
    for text in (words(1, BIG), y, words(3, BIG), words(4, BIG)):   # y saved on kv, then pushed out of its slot
        assert proxy.chat(user(text)).status_code == 200
        proxy.settle()   # each save done before the next request chooses its slot
    r = proxy.chat(user(y + " and more"))
    assert r.headers["x-lpcache-slot"] == "1:0" and r.headers["x-lpcache-restored"] == "true"
    proxy.settle()
    assert mock_stats(plain)["saves"] == 0 and mock_stats(plain)["restores"] == 0
    assert list(plain_dir.iterdir()) == []


def test_a_hanging_backend_times_out_and_is_cooled_down(start_backend: Any, start_proxy: Any) -> None:
    a, b = start_backend(), start_backend()
    proxy = start_proxy(a, b, request_timeout=1.0, breaker_cooldown_ms=60000)
    fault(a, hang=1)
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 502 and r.json()["error"]["type"] == "backend_unreachable"
    assert breaker(proxy, 0) == "open"
    assert proxy.chat(user(words(2, SMALL))).headers["x-lpcache-slot"].startswith("1:")
    proxy.settle()
    assert proxy.busy_slots() == []
