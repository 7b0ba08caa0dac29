"""COALESCE_REQUESTS: identical concurrent requests share one backend call."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from ..conftest import Proxy, user, words
from .conftest import mock_stats

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


def until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


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
