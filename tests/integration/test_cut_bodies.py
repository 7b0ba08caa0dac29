"""Answers that break halfway: error bodies, `/slots`, `/props`, `/health` and save answers cut or stalled by the
stand-in (`body_cut`, `body_stall`). After each: no busy slot, no waiter, a well-formed client answer (failover
where another backend exists), the prober alive; and a backend's own error passed on as it came."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from lpcache.backends import llama
from lpcache.config import BackendConfig
from lpcache.mock_llama import MockHandle

from ..conftest import Proxy, user, words
from .conftest import mock_stats

SMALL = 20
BIG = 200


def fault(backend: MockHandle, **faults: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json=faults).raise_for_status()


def armed(backend: MockHandle) -> dict[str, Any]:
    return httpx.get(f"{backend.url}/mock/faults").json()  # type: ignore[no-any-return]


def wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def short_error_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled error body is given up after half a second (10 s in production)."""
    monkeypatch.setattr(llama, "ERROR_BODY_SECONDS", 0.5)


def all_free(proxy: Proxy) -> None:
    """Nothing held: no busy slot in lpcache's state nor in GET /health, nobody waiting."""
    proxy.settle()
    assert proxy.busy_slots() == []
    health = proxy.client.get("/health").json()
    assert [b["busy_slots"] for b in health["backends"]] == [0] * len(health["backends"])
    assert health["waiting"] == 0


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"}
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["body_cut", "body_stall"])
def test_an_error_answer_whose_body_breaks_fails_over(start_backend: Any, start_proxy: Any, how: str) -> None:
    a, b = start_backend(), start_backend()
    proxy = start_proxy(a, b, request_timeout=5.0, breaker_cooldown_ms=60000)
    fault(a, status=500, status_count=1, **{how: 1})
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 200 and r.headers["x-lpcache-slot"].startswith("1:")
    assert r.json()["choices"][0]["message"]["content"]
    proxy.wait_finished(1)
    assert proxy.records[0].retries == 1
    assert proxy.pipeline.backends[0].breaker.state == "open"
    assert armed(a)[how] == 0   # the fault did fire
    all_free(proxy)


@pytest.mark.parametrize("how", ["body_cut", "body_stall"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_one_slot_server_keeps_serving_after_a_broken_error_body(start_backend: Any, start_proxy: Any, how: str,
                                                                    stream: bool) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend, request_timeout=2.0, breaker_cooldown_ms=1)
    fault(backend, status=503, status_count=1, **{how: 1})
    r = proxy.client.post("/v1/chat/completions", json={"messages": user(words(1, SMALL)), "stream": stream})
    assert openai_error(r, 502)["type"] == "backend_unreachable"
    all_free(proxy)
    for i in range(3):   # the one slot was given back: every later request is served
        r = proxy.client.post("/v1/chat/completions", json={"messages": user(words(2 + i, SMALL)), "stream": stream})
        assert r.status_code == 200
    all_free(proxy)


@pytest.mark.parametrize("how", ["body_cut", "body_stall"])
def test_cut_slots_and_props_bodies_on_a_request_s_way(start_backend: Any, start_proxy: Any, how: str) -> None:
    """A backend silent for a while is asked /props, /v1/models and /slots before its slots are used again; those
    answers break: the request is served all the same."""
    a = start_backend(slots=1)
    proxy = start_proxy(a, request_timeout=2.0)
    assert proxy.chat(user(words(1, BIG))).status_code == 200
    proxy.settle()
    backend = proxy.pipeline.backends[0]
    assert any(s.content is not None for s in proxy.pipeline.pool.slots)
    fault(a, paths=["/props", "/v1/models", "/slots"], **{how: 3})
    for i in range(3):
        backend.suspect, backend.last_seen = True, 0.0   # its slots are checked before this request
        r = proxy.chat(user(words(1, BIG) + f" and then {i}"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        all_free(proxy)
    assert armed(a)[how] == 0


def test_a_cut_slots_body_during_a_session_swap(start_backend: Any, start_proxy: Any) -> None:
    a = start_backend(slots=1)
    proxy = start_proxy(a, request_timeout=2.0)
    one, two = "1" * 32, "2" * 32
    # a small request: its session's cache is not saved after the answer, so the swap saves it first
    assert proxy.chat(user(words(1, SMALL)), headers={"X-Session-ID": one}).status_code == 200
    proxy.settle()
    fault(a, paths=["/slots"], body_cut=5)
    r = proxy.chat(user(words(2, BIG)), headers={"X-Session-ID": two})   # swaps one out: asks /slots first
    assert r.status_code == 200
    all_free(proxy)
    assert armed(a)["body_cut"] < 5


@pytest.mark.parametrize("how", ["body_cut", "body_stall"])
def test_the_prober_survives_broken_health_bodies(start_backend: Any, start_proxy: Any, how: str) -> None:
    """A down backend's /props and /health answers break while the prober asks: it keeps probing, and the backend
    serves as soon as it answers whole, long before its (60 s) cooldown is over."""
    a = start_backend()
    proxy = start_proxy(BackendConfig(a.url, 2, a.app_state.config.slot_save_path), request_timeout=1.0,
                        breaker_cooldown_ms=60000)
    backend = proxy.pipeline.backends[0]
    fault(a, paths=["/props", "/health", "/v1/models"], **{how: 4})
    proxy.run(_fail(backend))
    wait_for(lambda: armed(a)[how] == 0)
    wait_for(lambda: backend.breaker.state == "closed")
    assert backend.breaker.failures == 0   # closed by the prober (nothing else asks it), after every break
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 200 and r.headers["x-lpcache-slot"].startswith("0:")
    all_free(proxy)


async def _fail(backend: Any) -> None:
    backend.failed("test: taken down")


@pytest.mark.parametrize("how", ["body_cut", "body_stall"])
def test_a_broken_save_answer_is_retried_and_the_slot_given_back(start_backend: Any, start_proxy: Any,
                                                                  how: str) -> None:
    a = start_backend(slots=1)
    proxy = start_proxy(a, request_timeout=1.5, save_retries=2)
    fault(a, paths=["/slots/0"], **{how: 1})
    assert proxy.chat(user(words(1, BIG))).status_code == 200
    proxy.wait_finished(1)
    assert proxy.records[0].saved is True          # the retry saved it
    assert armed(a)[how] == 0
    assert mock_stats(a)["requests_by_path"]["/slots/0"] == 2
    all_free(proxy)
    assert proxy.chat(user(words(2, SMALL))).status_code == 200
    all_free(proxy)


def test_a_501_turns_saving_off_with_one_line(start_backend: Any, start_proxy: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    a = start_backend(slots=1)
    proxy = start_proxy(a, save_retries=3, save_retry_delay_ms=2000)
    fault(a, save_status=501)
    started = time.monotonic()
    for i in range(3):
        assert proxy.chat(user(words(i, BIG))).status_code == 200
        proxy.settle()
    assert time.monotonic() - started < 2.0        # never retried (the delay is 2 s)
    assert mock_stats(a)["requests_by_path"]["/slots/0"] == 1   # asked once, then never again
    assert proxy.pipeline.backends[0].saves_off
    assert caplog.text.count("slot_saving_off") == 1
    assert [r.saved for r in proxy.records] == [False, None, None]
    all_free(proxy)


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_a_refused_save_is_not_retried(start_backend: Any, start_proxy: Any, status: int) -> None:
    a = start_backend(slots=1)
    proxy = start_proxy(a, save_retries=3, save_retry_delay_ms=2000)
    fault(a, save_status=status, save_fail_count=1)
    started = time.monotonic()
    assert proxy.chat(user(words(1, BIG))).status_code == 200
    proxy.settle()
    assert time.monotonic() - started < 2.0
    assert mock_stats(a)["requests_by_path"]["/slots/0"] == 1
    assert proxy.records[0].saved is False and not proxy.pipeline.backends[0].saves_off
    all_free(proxy)


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_error_passes_on_as_it_came(start_backend: Any, start_proxy: Any, stream: bool) -> None:
    a = start_backend(n_ctx=64)
    proxy = start_proxy(a)
    r = proxy.client.post("/v1/chat/completions", json={"messages": user(words(1, 100)), "stream": stream})
    direct = httpx.post(f"{a.url}/v1/chat/completions", json={"messages": user(words(1, 100)), "stream": stream})
    assert r.status_code == direct.status_code == 400
    assert r.content == direct.content
    assert r.headers["content-type"] == direct.headers["content-type"]
    err = orjson.loads(r.content)["error"]
    assert err["n_ctx"] == 64 and err["n_prompt_tokens"] > 64 and err["type"] == "exceed_context_size_error"
    all_free(proxy)


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_stream_cut_halfway_through_its_first_event_is_tried_again(start_backend: Any, start_proxy: Any,
                                                                       coalesced: bool) -> None:
    """The stand-in sends half of its first event and cuts the connection: nothing of it went to the client (an
    answer starts with its first whole event), so the request is sent again; the client (and a coalesced follower)
    gets one whole answer."""
    a = start_backend(slots=2, gen_ms_per_token=20)
    proxy = start_proxy(a, request_timeout=2.0, coalesce_requests=coalesced)
    fault(a, body_cut=1)
    body = {"messages": user(words(1, SMALL)), "stream": True, "max_tokens": 4}
    with httpx.Client(base_url=proxy.url, timeout=30) as c1, httpx.Client(base_url=proxy.url, timeout=30) as c2:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda c: c.post("/v1/chat/completions", json=body), [c1, c2][:1 + coalesced]))
    assert armed(a)["body_cut"] == 0
    for r in answers:
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n"), r.content
        events = r.content[:-2].split(b"\n\n")
        assert all(e.startswith(b"data: ") for e in events), r.content
        assert not any("error" in orjson.loads(e[6:]) for e in events[:-1])
    proxy.wait_finished(len(answers))
    assert sum(rec.retries for rec in proxy.records) == 1   # the leader's one retry
    all_free(proxy)


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_stream_cut_halfway_through_an_event_ends_with_whole_events(start_backend: Any, start_proxy: Any,
                                                                        coalesced: bool) -> None:
    """The stand-in sends two whole events, half of the third, and cuts the connection: the client (and a coalesced
    follower) gets whole events only, the last one lpcache's error, never half an event glued to the error event."""
    a = start_backend(slots=2, gen_ms_per_token=20)
    proxy = start_proxy(a, request_timeout=2.0, coalesce_requests=coalesced)
    fault(a, stream_break_after=2, stream_break_count=1, stream_break_half=True)
    body = {"messages": user(words(1, SMALL)), "stream": True, "max_tokens": 4}
    with httpx.Client(base_url=proxy.url, timeout=30) as c1, httpx.Client(base_url=proxy.url, timeout=30) as c2:
        if coalesced:
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda c: c.post("/v1/chat/completions", json=body), [c1, c2]))
        else:
            answers = [c1.post("/v1/chat/completions", json=body)]
    assert armed(a)["stream_break_after"] is None   # the fault did fire
    broken = 0
    for r in answers:
        assert r.status_code == 200 and r.content.endswith(b"\n\n"), r.content
        events = r.content[:-2].split(b"\n\n")
        assert all(e.startswith(b"data: ") for e in events), r.content
        if events[-1] == b"data: [DONE]":   # a second client that came after the group: a whole answer
            events.pop()
        docs = [orjson.loads(e[6:]) for e in events]   # every one parses
        broken += "error" in docs[-1]
    assert broken >= 1
    proxy.wait_finished(len(answers))
    all_free(proxy)


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_stream_cut_right_after_done_is_whole(start_backend: Any, start_proxy: Any, coalesced: bool) -> None:
    """The connection breaks after the stream's last event ([DONE]): the answer is whole, nothing follows [DONE]
    (no error event), and it counts as answered (the big prompt is saved)."""
    a = start_backend(slots=2, gen_ms_per_token=20)
    proxy = start_proxy(a, request_timeout=2.0, coalesce_requests=coalesced)
    # head, 4 tokens, finish (with timings), [DONE]: 7 events, all sent before the cut
    fault(a, stream_break_after=7, stream_break_count=1)
    body = {"messages": user(words(3, BIG)), "stream": True, "max_tokens": 4}
    with httpx.Client(base_url=proxy.url, timeout=30) as c1, httpx.Client(base_url=proxy.url, timeout=30) as c2:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda c: c.post("/v1/chat/completions", json=body), [c1, c2][:1 + coalesced]))
    assert armed(a)["stream_break_after"] is None   # the fault did fire
    for r in answers:
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n"), r.content
        assert b'"error"' not in r.content
    proxy.wait_finished(len(answers))
    assert proxy.records[0].reason is None and any(r.saved for r in proxy.records)
    all_free(proxy)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_an_error_page_that_is_not_json_passes_on_and_ends_the_coalesced_group(start_backend: Any, start_proxy: Any,
                                                                                 path: str) -> None:
    """A web server in front of llama-server answers with an HTML error page: the first request's client gets it as
    it came; the identical requests that joined it get the same status with a JSON error; the group is closed, so
    the same request, once the backend is well again, is answered."""
    a = start_backend(slots=2)
    proxy = start_proxy(a, coalesce_requests=True)
    fault(a, status=502, status_page=True, latency_ms=400, paths=["/v1/chat/completions"])
    body = ({"messages": user(words(5, SMALL)), "max_tokens": 4} if path == "/v1/chat/completions" else
            {"model": "m", "max_tokens": 4, "messages": user(words(5, SMALL))})
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: httpx.post(proxy.url + path, json=body, timeout=30), range(3)))
    assert sorted(r.status_code for r in answers) == [502] * 3, [r.text for r in answers]
    pages = [r for r in answers if r.headers["content-type"].startswith("text/html")]
    assert len(pages) == 1 and "<title>502 Bad Gateway</title>" in pages[0].text   # the first one's, as it came
    for r in answers:
        if r is not pages[0]:
            assert r.headers["x-lpcache-coalesced"] == "true" and r.headers["content-type"] == "application/json"
            doc = r.json()   # the API's own error shape: OpenAI's, or Anthropic's on /v1/messages
            assert (doc.get("type") == "error") is (path == "/v1/messages"), doc
            assert "502" in doc["error"]["message"] and doc["error"]["type"] == "backend_error", doc
    fault(a, status=None, latency_ms=0)
    again = httpx.post(proxy.url + path, json=body, timeout=30)
    assert again.status_code == 200 and "x-lpcache-coalesced" not in again.headers
    assert all(r.status != 500 for r in proxy.records)
    all_free(proxy)
