"""Faults while a backend's requests go unpinned (`flow.unpinned`): streams cut mid-body, connections dropped before
a byte, error answers, clients that leave before the first token or mid-stream, bodies cut short, coalesced groups
whose leader leaves. After each, no slot stays taken, no unpinned request stays counted (`inflight`), no client
keeps a generating share (`pool.generating`), and the backend is still unpinned and answers: a count left behind
would keep the switch back to pinned closed for good, or a client's fair share taken."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx

from ..conftest import user
from .conftest import until
from .test_unpinned import FAST, go_unpinned, on_loop, state, streamed_at_once


def fault(backend: Any, **faults: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json=faults).raise_for_status()


def settled(proxy: Any, what: str) -> None:
    p = proxy.pipeline

    def clean() -> bool:
        return not any(s.busy for s in p.pool.slots) and p.unpinned.inflight[0] == 0 and not p.pool.generating

    try:
        until(clean, timeout=15)
    except AssertionError:
        seen = on_loop(proxy, lambda: (p.unpinned.state[0], p.unpinned.inflight[0], dict(p.pool.generating),
                                       [(s.id, s.busy) for s in p.pool.slots]))
        raise AssertionError(f"{what}: left behind (state, inflight, generating, slots): {seen}") from None


def at_once(*calls: Callable[[], None]) -> None:
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def leave_after_first_token(proxy: Any, body: dict[str, Any]) -> Callable[[], None]:
    def leave() -> None:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    return leave


def test_no_fault_leaves_a_slot_a_count_or_a_share_behind(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=2, gen_ms_per_token=20.0, **FAST)
    proxy = start_proxy(backend, big_threshold_words=None, meta_max=0, request_timeout=20.0)
    go_unpinned(proxy, [[], []])
    assert state(proxy) == "unpinned"
    body = {"messages": user("Tell me a story about caches."), "max_tokens": 20}

    fault(backend, stream_break_after=3, stream_break_count=3)   # streams cut mid-body, several at once
    streamed_at_once(proxy, [body] * 4)
    settled(proxy, "streams cut")
    fault(backend, stream_break_after=None)

    fault(backend, drop=1)   # the connection dropped before a byte: tried again
    assert proxy.chat(user("Dropped?"), max_tokens=4).status_code == 200
    settled(proxy, "connection dropped")

    fault(backend, status=500, status_count=2)   # error answers, JSON and streamed
    assert proxy.chat(user("An error, then?"), max_tokens=4).status_code >= 400
    streamed_at_once(proxy, [body])
    settled(proxy, "error answers")

    fault(backend, latency_ms=3000, paths=["/v1/chat/completions", "/chat/completions"])
    for stream in (True, False):   # the client leaves before the first token
        try:
            httpx.post(proxy.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=0.5)
        except httpx.HTTPError:
            pass
    fault(backend, latency_ms=0.0)
    settled(proxy, "left before the first token")

    fault(backend, body_cut=1)   # a JSON body cut short
    proxy.chat(user("A cut body?"), max_tokens=4)
    settled(proxy, "body cut")

    at_once(*[leave_after_first_token(proxy, {**body, "max_tokens": 200})] * 4)   # clients leave mid-stream
    settled(proxy, "left mid-stream")

    assert state(proxy) == "unpinned"
    assert proxy.chat(user("Still there?"), max_tokens=4).status_code == 200
    settled(proxy, "the last answer")


def test_coalesced_groups_whose_members_leave_leave_nothing_behind(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=2, gen_ms_per_token=30.0, **FAST)
    proxy = start_proxy(backend, big_threshold_words=None, meta_max=0, coalesce_requests=True)
    go_unpinned(proxy, [[], []])
    body = {"messages": user("Same question for all, please."), "max_tokens": 30, "stream": True}
    leave = leave_after_first_token(proxy, body)
    answered: list[int] = []

    def stay() -> None:
        answered.append(httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30).status_code)

    for group in ((leave, stay, stay), (leave, leave, leave), (stay, leave)):
        at_once(*group)
        settled(proxy, f"a coalesced group: {[f.__name__ for f in group]}")
    assert answered == [200, 200, 200]   # those that stayed got the answer their leader left
    fault(backend, stream_break_after=2, stream_break_count=1)   # the shared answer's stream cut
    at_once(stay, stay, stay)
    settled(proxy, "a coalesced answer cut")
    assert state(proxy) == "unpinned"
