"""COALESCE_REQUESTS: identical concurrent requests share one backend call."""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig

from ..conftest import Proxy, user, words
from .conftest import mock_stats, until

QUESTION = user(words(1, 30))


def content_of(r: httpx.Response, stream: bool) -> str:
    if not stream:
        return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]
    parts = []
    for line in r.text.split("\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def send(proxy: Proxy, stream: bool, **extra: Any) -> httpx.Response:
    return proxy.client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 40,
                                                          "temperature": 0, "stream": stream, **extra})


def test_twenty_identical_requests_make_one_backend_call(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=50)           # 40 tokens: 2 s to generate
    proxy = start_proxy(backend, coalesce_requests=True)
    with ThreadPoolExecutor(20) as pool:
        leader = pool.submit(send, proxy, True)
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        followers = [pool.submit(send, proxy, i % 2 == 0) for i in range(19)]
        until(lambda: proxy.pipeline.coalescer.active()[0][1] == 19 if proxy.pipeline.coalescer.active() else True)
        results = [(True, leader.result())] + [(i % 2 == 0, f.result()) for i, f in enumerate(followers)]
    assert mock_stats(backend)["chat_requests"] == 1
    answers = {content_of(r, stream) for stream, r in results}
    assert all(r.status_code == 200 for _, r in results)
    assert len(answers) == 1 and len(answers.pop().split()) == 40
    assert sum(1 for _, r in results if r.headers.get("x-lpcache-coalesced") == "true") == 19
    proxy.wait_finished(20)
    assert sum(1 for rec in proxy.records if rec.coalesced) == 19
    assert len(proxy.pipeline.coalescer) == 0 and proxy.busy_slots() == []


def test_json_followers_of_a_streaming_leader_get_a_full_completion(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=30)
    proxy = start_proxy(backend, coalesce_requests=True)
    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(send, proxy, True, stream_options={"include_usage": True})
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        follower = pool.submit(send, proxy, False).result()
        leader_text = content_of(leader.result(), True)
    doc = follower.json()
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["content"] == leader_text
    assert doc["usage"]["completion_tokens"] == 40 and "timings" in doc


def test_a_late_follower_gets_the_stream_from_its_first_event(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=30)
    proxy = start_proxy(backend, coalesce_requests=True)
    with ThreadPoolExecutor(2) as pool, proxy.client.stream(
            "POST", "/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 40, "temperature": 0, "stream": True}) as lead:
        chunks = lead.iter_raw()
        first = next(chunks) + next(chunks)               # the leader's client already has some events
        late = pool.submit(send, proxy, True)
        until(lambda: bool(proxy.pipeline.coalescer.active()) and proxy.pipeline.coalescer.active()[0][1] == 1)
        leader_raw = first + b"".join(chunks)
        follower_raw = late.result().content
    strip = lambda raw: [e for e in raw.split(b"\n\n") if e]  # noqa: E731
    assert strip(follower_raw) == strip(leader_raw)
    assert mock_stats(backend)["chat_requests"] == 1


def test_different_generation_parameters_are_separate_calls(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=20)
    proxy = start_proxy(backend, coalesce_requests=True)
    with ThreadPoolExecutor(4) as pool:
        results = [pool.submit(send, proxy, False, temperature=t) for t in (0, 0.5, 0.9, 1.2)]
        assert all(r.result().status_code == 200 for r in results)
    assert mock_stats(backend)["chat_requests"] == 4


def test_a_new_group_starts_once_the_old_one_completed(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, coalesce_requests=True)
    for _ in range(3):
        assert send(proxy, False).status_code == 200
    assert mock_stats(backend)["chat_requests"] == 3


def test_with_the_flag_off_every_request_has_its_own_call(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=20)
    proxy = start_proxy(backend)
    with ThreadPoolExecutor(6) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda _: send(proxy, False), range(6)))
    assert mock_stats(backend)["chat_requests"] == 6
    assert all(rec.coalesced is None for rec in proxy.records)


def test_followers_get_the_leaders_error(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=30)
    proxy = start_proxy(backend, coalesce_requests=True)
    httpx.post(f"{backend.url}/mock/faults", json={"stream_break_after": 5, "stream_break_count": 1})
    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(send, proxy, True)
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        follower = pool.submit(send, proxy, False).result()
        assert b'"error"' in leader.result().content
    assert follower.status_code == 502 and follower.json()["error"]["message"]
    proxy.wait_finished(2)
    assert proxy.busy_slots() == [] and len(proxy.pipeline.coalescer) == 0


@pytest.mark.parametrize("leader_streams", [True, False])
def test_a_streaming_follower_gets_a_backend_error_as_its_leader_did(start_backend: Any, start_proxy: Any,
                                                                      leader_streams: bool) -> None:
    """An error answer before any byte (a 400 with llama-server's own fields) reaches a streaming follower with its
    status and JSON body, as it would alone: not as a 200 stream holding one error event."""
    backend = start_backend()
    proxy = start_proxy(backend, coalesce_requests=True)
    httpx.post(f"{backend.url}/mock/faults", json={"status": 400, "latency_ms": 600})
    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(send, proxy, leader_streams)
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        follower = pool.submit(send, proxy, True).result()
        alone = leader.result()
    assert alone.status_code == 400 and "x-lpcache-coalesced" not in alone.headers
    assert follower.headers.get("x-lpcache-coalesced") == "true"
    assert follower.status_code == 400 and follower.headers["content-type"].startswith("application/json")
    assert follower.json() == alone.json()
    proxy.wait_finished(2)
    assert proxy.busy_slots() == [] and len(proxy.pipeline.coalescer) == 0


def test_followers_still_get_the_answer_when_the_first_client_leaves(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=30)
    proxy = start_proxy(backend, coalesce_requests=True)
    with ThreadPoolExecutor(1) as pool:
        with proxy.client.stream("POST", "/v1/chat/completions",
                                 json={"messages": QUESTION, "max_tokens": 40, "temperature": 0,
                                       "stream": True}) as lead:
            chunks = lead.iter_raw()
            next(chunks)
            # (a client of its own: the leader's httpx client holds its pool while that stream is open)
            follower = pool.submit(httpx.post, f"{proxy.url}/v1/chat/completions", timeout=60, json={
                "messages": QUESTION, "max_tokens": 40, "temperature": 0, "stream": False})
            until(lambda: bool(proxy.pipeline.coalescer.active()) and proxy.pipeline.coalescer.active()[0][1] == 1)
        # the first client is gone; the follower still gets the whole answer
        r = follower.result()
    assert r.status_code == 200 and len(content_of(r, False).split()) == 40
    proxy.wait_finished(2)
    leader_record = next(rec for rec in proxy.records if not rec.coalesced)
    assert leader_record.reason == "client_disconnected"
    assert mock_stats(backend)["chat_requests"] == 1 and proxy.busy_slots() == []


# ---- a leader whose client leaves; followers that leave ----

def raw_post(proxy: Proxy, body: dict[str, Any], headers: dict[str, str] | None = None) -> socket.socket:
    """A chat request on a socket of its own, so the test can close it at any point of the answer."""
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    sock = socket.create_connection(("127.0.0.1", proxy.server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
                 + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def received(sock: socket.socket, until: bytes | None = None, timeout: float = 20.0) -> bytes:
    """What came so far (nothing waited for), or, with `until`, everything up to that marker."""
    got = b""
    sock.settimeout(0 if until is None else 0.2)
    deadline = time.monotonic() + timeout
    while until is None or until not in got:
        try:
            chunk = sock.recv(65536)
        except (BlockingIOError, TimeoutError):
            if until is None:
                return got
            assert time.monotonic() < deadline, f"no {until!r} in {got!r}"
            continue
        if not chunk:
            break
        got += chunk
    return got


def followers_of(proxy: Proxy) -> int:
    active = proxy.pipeline.coalescer.active()
    return active[0][1] if active else -1


LONG = {"messages": QUESTION, "max_tokens": 40, "temperature": 0}


@pytest.mark.parametrize("point", ["before_first_byte", "mid_json", "mid_sse"])
def test_followers_get_the_whole_answer_when_the_leader_leaves(start_backend: Any, start_proxy: Any,
                                                               point: str) -> None:
    # before_first_byte: the backend is still reading the prompt; mid_json: it generates a JSON answer (nothing
    # reaches a JSON client before the end); mid_sse: the leader's client already has some events.
    # (slow enough that the followers join and the test looks at the leader's socket well before the answer ends)
    backend = start_backend(**({"prefill_ms_per_token": 200} if point == "before_first_byte" else
                               {"gen_ms_per_token": 100}))
    proxy = start_proxy(backend, coalesce_requests=True)
    leader = raw_post(proxy, LONG | {"stream": point != "mid_json"})
    until(lambda: len(proxy.pipeline.coalescer) == 1)
    with ThreadPoolExecutor(2) as pool:
        followers = [pool.submit(httpx.post, f"{proxy.url}/v1/chat/completions", timeout=60,
                                 json=LONG | {"stream": stream}) for stream in (False, True)]
        until(lambda: followers_of(proxy) == 2)
        if point == "mid_sse":
            assert b"data: " in received(leader, until=b"data: ")
        else:
            assert received(leader) == b""       # not a byte reached the leader's client yet
        leader.close()
        results = [f.result() for f in followers]
    assert [r.status_code for r in results] == [200, 200]
    assert [r.headers.get("x-lpcache-coalesced") for r in results] == ["true", "true"]
    texts = {content_of(r, stream) for r, stream in zip(results, (False, True), strict=True)}
    assert len(texts) == 1 and len(texts.pop().split()) == 40
    proxy.wait_finished(3)
    leader_record = next(rec for rec in proxy.records if not rec.coalesced)
    assert leader_record.reason == "client_disconnected"
    assert all(rec.reason is None for rec in proxy.records if rec.coalesced)
    assert mock_stats(backend)["chat_requests"] == 1
    assert proxy.busy_slots() == [] and len(proxy.pipeline.coalescer) == 0


@pytest.mark.parametrize("leader_stream", [True, False])
def test_when_the_leader_and_every_follower_leave_the_work_stops(start_backend: Any, start_proxy: Any,
                                                                leader_stream: bool) -> None:
    backend = start_backend(slots=1, gen_ms_per_token=50)            # 400 tokens: 20 s if nobody stopped it
    proxy = start_proxy(backend, coalesce_requests=True)
    body = LONG | {"max_tokens": 400}
    started = time.monotonic()
    leader = raw_post(proxy, body | {"stream": leader_stream})
    until(lambda: len(proxy.pipeline.coalescer) == 1)
    followers = [raw_post(proxy, body | {"stream": stream}) for stream in (False, True)]
    until(lambda: followers_of(proxy) == 2)
    until(lambda: mock_stats(backend)["chat_requests"] == 1)
    leader.close()
    if leader_stream:     # the answer goes on for the followers (of a JSON leader, they get it at its end)
        assert b"data: " in received(followers[1], until=b"data: ")
    followers[0].close()
    until(lambda: followers_of(proxy) == 1)
    assert proxy.busy_slots() != []                                   # one follower left: still generating
    followers[1].close()
    proxy.wait_finished(3)
    until(lambda: proxy.busy_slots() == [])
    assert time.monotonic() - started < 15                            # stopped, not generated to its end
    assert len(proxy.pipeline.coalescer) == 0
    assert {rec.reason for rec in proxy.records} == {"client_disconnected"}
    r = send(proxy, False)                                            # the slot is free for the next request
    assert r.status_code == 200 and r.headers.get("x-lpcache-coalesced") is None


# ---- who asks ----

def test_a_client_with_a_wrong_key_gets_its_own_answer(start_backend: Any, start_proxy: Any) -> None:
    # lpcache holds no client keys: the clients' own keys go to llama-server, which checks them
    backend = start_backend(api_key="right", gen_ms_per_token=30)
    proxy = start_proxy(BackendConfig(backend.url, 2, backend.app_state.config.slot_save_path),
                        coalesce_requests=True)
    right = {"Authorization": "Bearer right"}
    with ThreadPoolExecutor(3) as pool:
        leader = pool.submit(proxy.client.post, "/v1/chat/completions", json=LONG, headers=right)
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        wrong = pool.submit(httpx.post, f"{proxy.url}/v1/chat/completions", json=LONG, timeout=60,
                            headers={"Authorization": "Bearer wrong"}).result()
        same = pool.submit(httpx.post, f"{proxy.url}/v1/chat/completions", json=LONG, timeout=60, headers=right)
        assert leader.result().status_code == 200
    assert wrong.status_code == 401 and wrong.headers.get("x-lpcache-coalesced") is None
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert same.result().status_code == 200      # the same key shares as before (or came after the answer)
    proxy.wait_finished(3)
    assert proxy.busy_slots() == []


def test_two_tenants_never_share_an_answer(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    backend = start_backend(gen_ms_per_token=30)
    cache = {"name": "result_cache", "params": {"dir": str(tmp_path / "results")}}
    proxy = start_proxy(backend, coalesce_requests=True, api_keys=("key-one", "key-two"), plugins=(cache,))
    one, two = ({"Authorization": f"Bearer key-{n}"} for n in ("one", "two"))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(proxy.client.post, "/v1/chat/completions", json=LONG, headers=one)
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        other = httpx.post(f"{proxy.url}/v1/chat/completions", json=LONG, headers=two, timeout=60)
        assert first.result().status_code == 200
    assert other.status_code == 200 and other.headers.get("x-lpcache-coalesced") is None
    assert mock_stats(backend)["chat_requests"] == 2                 # not coalesced across tenants
    proxy.wait_finished(2)
    assert len(os.listdir(tmp_path / "results")) == 2                 # one stored answer per tenant
    for headers in (one, two):                                        # each tenant hits its own entry only
        hit = proxy.client.post("/v1/chat/completions", json=LONG, headers=headers)
        assert hit.status_code == 200 and hit.headers.get("x-lpcache-served-by") == "prefilter"
    assert mock_stats(backend)["chat_requests"] == 2


@pytest.mark.parametrize("same_session", [True, False])
def test_the_session_is_part_of_the_group(start_backend: Any, start_proxy: Any, same_session: bool) -> None:
    backend = start_backend(gen_ms_per_token=50)
    proxy = start_proxy(backend, coalesce_requests=True)
    sessions = ["a" * 32, "a" * 32 if same_session else "b" * 32]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(proxy.client.post, "/v1/chat/completions", json=LONG,
                            headers={"X-Session-ID": sessions[0]})
        until(lambda: len(proxy.pipeline.coalescer) == 1)
        second = httpx.post(f"{proxy.url}/v1/chat/completions", json=LONG, timeout=60,
                            headers={"X-Session-ID": sessions[1]})
        assert first.result().status_code == 200 and second.status_code == 200
    assert (second.headers.get("x-lpcache-coalesced") == "true") is same_session
    assert mock_stats(backend)["chat_requests"] == (1 if same_session else 2)


def test_a_deeply_nested_body_is_a_400_with_coalescing_on(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, coalesce_requests=True)
    depth = 300                     # orjson reads it (up to 1024 levels) but writes at most 254
    body = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * depth + b"]" * depth + b"}"
    r = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["type"] == "invalid_request_error"
    proxy.wait_finished(1)
    assert proxy.busy_slots() == [] and len(proxy.pipeline.coalescer) == 0
