"""Unpinned requests (`flow.unpinned`) against the stand-in: once the server's RAM serves every return and
BIG_THRESHOLD_WORDS=auto saves nothing, requests go without `id_slot` and the server queues them itself; a return
the server lost switches back to pinning, and the two kinds never overlap on the server."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Any

import httpx
import pytest

from lpcache.cache.server_cache import RAM_TRUST
from lpcache.flow.unpinned import QUIET_REQUESTS

from ..conftest import RAM_SERVED_TOKENS, user
from .conftest import mock_stats, until

FAST = {"prefill_ms_per_token": 0.04, "kv_bytes_per_token": 23_040}   # a GPU's prefill: auto saves nothing
TEXTS = [
    "Hi! Could you explain what a KV cache is, in two sentences? Merci 🙂",
    "Write a Python function `def mean(xs: list[float]) -> float:` that returns 0.0 for an empty list.",
    "¿Cuál es la diferencia entre un proceso y un hilo? Respond in English, please.",
    "Summarise: 'The quick brown fox jumps over the lazy dog' — why is it used for fonts?",
]


def on_loop(proxy: Any, fn: Any) -> Any:
    async def call() -> Any:
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), proxy.app.state.loop).result(10)


def trust_ram(proxy: Any) -> None:
    """What a real server's RAM cache would have shown by now: RAM_TRUST returns left to it, each served."""
    def seen() -> None:
        for backend in proxy.pipeline.backends:
            for _ in range(RAM_TRUST):
                backend.ram.seen(True, time.monotonic(), RAM_SERVED_TOKENS)
    on_loop(proxy, seen)


def state(proxy: Any) -> str:
    return str(proxy.pipeline.unpinned.state[0])


def converse(proxy: Any, histories: list[list[dict[str, Any]]], turn: int, **body: Any) -> list[httpx.Response]:
    """One turn of each conversation, in turn, the stand-in's answers fed back."""
    answers = []
    for c, history in enumerate(histories):
        history.append({"role": "user", "content": f"{TEXTS[(c + turn) % len(TEXTS)]} (turn {turn})"})
        r = proxy.chat(history, max_tokens=6, **body)
        assert r.status_code == 200, r.text
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        answers.append(r)
        proxy.settle()
    return answers


def slow_prefill(proxy: Any, ms_per_token: float = 100.0) -> None:
    """lpcache takes the server's prefill for `ms_per_token` from now on (its recent measures all that), so that
    a miss costs more than RAM_BET_SECONDS; the stand-in itself stays fast."""
    async def slow() -> None:
        for (_, _), speeds in proxy.pipeline.speeds.items():
            speeds.prefill.recent.extend([ms_per_token] * (speeds.prefill.recent.maxlen or 1))
            speeds.prefill.ms_per_token = ms_per_token
    proxy.run(slow())


def go_unpinned(proxy: Any, histories: list[list[dict[str, Any]]]) -> int:
    """Quiet pinned requests until the backend's requests go unpinned; the turns it took."""
    trust_ram(proxy)
    turn = 0
    while state(proxy) != "unpinned":
        assert turn * len(histories) <= QUIET_REQUESTS + len(histories), state(proxy)
        converse(proxy, histories, turn)
        turn += 1
    return turn


def lighthouse_story(proxy: Any) -> list[dict[str, Any]]:
    """A long French story's first turn, session "phare", its answer fed back: the history to continue."""
    story = [{"role": "system", "content": "Tu es un conteur. Réponds en français, avec des phrases courtes."},
             {"role": "user", "content": "Raconte l'histoire d'un phare 🗼 au bord de la mer, " * 80}]
    r = proxy.chat(story, {"X-Session-ID": "phare"}, max_tokens=6)
    assert r.status_code == 200, r.text
    story.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    proxy.settle()
    return story


def streamed_at_once(proxy: Any, bodies: list[dict[str, Any]]) -> list[tuple[int, str]]:
    results: list[tuple[int, str]] = [(0, "")] * len(bodies)

    def send(i: int) -> None:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={**bodies[i], "stream": True},
                          timeout=60) as r:
            results[i] = (r.status_code, r.read().decode())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def idle_everywhere(proxy: Any) -> bool:
    return not any(s.busy for s in proxy.pipeline.pool.slots) and proxy.pipeline.unpinned.inflight[0] == 0


def test_requests_go_unpinned_and_the_server_queues_them(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=2, gen_ms_per_token=15.0, **FAST)
    proxy = start_proxy(backend, big_threshold_words=None, meta_max=0)
    histories: list[list[dict[str, Any]]] = [[], []]
    turns = go_unpinned(proxy, histories)
    before = mock_stats(backend)
    assert before["unpinned_requests"] == 0 and before["saves"] == 0
    pinning = f'lpcache_backend_pinning{{backend="{backend.url}",state="unpinned"}} 1.0'
    assert pinning in proxy.client.get("/metrics").text
    # each conversation's return: the server finds its prompt itself (the stand-in: in the slot it chooses for it)
    previous = [r.json()["usage"]["prompt_tokens"] for r in converse(proxy, histories, turns - 1)]
    returns = converse(proxy, histories, turns)
    assert [r.json()["timings"]["cache_n"] >= p for r, p in zip(returns, previous, strict=True)] == [True, True]
    assert [r.route for r in proxy.records[-2:]] == ["unpinned"] * 2 and state(proxy) == "unpinned"
    assert [r.headers["x-lpcache-slot"] for r in returns] == ["0:-1", "0:-1"]
    before = mock_stats(backend)
    # six clients at once on two slots: lpcache hands out a place per slot, freed at each first token, so the
    # next request waits inside the server (as it would without lpcache), not in lpcache's line
    bodies = [{"messages": user(f"{TEXTS[i % 4]} [{i}]"), "max_tokens": 12} for i in range(6)]
    results = streamed_at_once(proxy, bodies)
    assert all(status == 200 and "[DONE]" in text for status, text in results), results
    after = mock_stats(backend)
    assert after["unpinned_requests"] - before["unpinned_requests"] == 6
    assert after["max_queued"] >= 1, after
    assert after["pinned_to_busy"] == 0 and after["saves"] == 0
    until(lambda: idle_everywhere(proxy))
    assert [r.route for r in proxy.records[-6:]] == ["unpinned"] * 6
    metrics = proxy.client.get("/metrics").text
    assert 'lpcache_unpinned_requests_total 10.0' in metrics
    # no restore was tried for them: none counted as failed, on /metrics or the dashboard
    assert 'lpcache_restores_total{result="failed"} 0.0' in metrics
    assert [r.restored for r in proxy.records[-6:]] == [None] * 6


def test_a_return_the_server_lost_pins_requests_again_without_overlap(start_backend: Any, start_proxy: Any,
                                                                        caplog: Any) -> None:
    backend = start_backend(slots=2, gen_ms_per_token=10.0, **FAST)
    proxy = start_proxy(backend, big_threshold_words=None, meta_max=0)
    histories: list[list[dict[str, Any]]] = [[], []]
    turns = go_unpinned(proxy, histories)
    # the stand-in has no RAM cache: two other conversations take both slots, then the first returns and is
    # computed again (a miss), while four more requests arrive at once
    others: list[list[dict[str, Any]]] = [[], []]
    converse(proxy, others, 0)
    converse(proxy, others, 0)   # each of the two slots now holds one of them, whichever the server chose
    slow_prefill(proxy)          # the miss costs seconds: a CPU's (a GPU's would not be worth pinning again)
    bodies = [{"messages": [*histories[0], {"role": "user", "content": "And then?"}], "max_tokens": 8}]
    bodies += [{"messages": user(f"{TEXTS[i]} — now quickly, please [{i}]"), "max_tokens": 8} for i in range(4)]
    with caplog.at_level("INFO", logger="lpcache.unpinned"):
        results = streamed_at_once(proxy, bodies)
        until(lambda: state(proxy) == "pinned" and idle_everywhere(proxy))
    assert all(status == 200 and "[DONE]" in text for status, text in results), results
    assert "unpinned_miss" in caplog.text and "unpinned_off" in caplog.text
    assert mock_stats(backend)["pinned_to_busy"] == 0
    # pinned again: the next request carries `id_slot`; what each slot holds is unknown to lpcache until used
    unpinned = mock_stats(backend)["unpinned_requests"]
    r = converse(proxy, histories, turns + 1)[0]
    assert mock_stats(backend)["unpinned_requests"] == unpinned
    assert proxy.records[-1].route != "unpinned" and r.headers["x-lpcache-slot"] in ("0:0", "0:1")


def test_a_client_that_leaves_mid_stream_leaves_no_place_taken(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=2, gen_ms_per_token=40.0, **FAST)
    proxy = start_proxy(backend, big_threshold_words=None, meta_max=0)
    go_unpinned(proxy, [[], []])
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30,
                      json={"messages": user("Tell me a long story about caches, 🐍 and C++."), "stream": True,
                            "max_tokens": 200}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break   # the first token: the client leaves
    until(lambda: idle_everywhere(proxy))
    assert proxy.chat(user("Still there?"), max_tokens=4).status_code == 200
    until(lambda: idle_everywhere(proxy))
    assert state(proxy) == "unpinned" and mock_stats(backend)["pinned_to_busy"] == 0


def test_only_auto_on_one_backend_without_replicas_goes_unpinned(start_backend: Any, start_proxy: Any) -> None:
    fixed = start_backend(slots=2, **FAST)
    proxy = start_proxy(fixed, big_threshold_words=500, meta_max=0)
    trust_ram(proxy)
    converse(proxy, [[], []], 0)
    for turn in range(1, QUIET_REQUESTS):
        converse(proxy, [[], []], turn)
    assert state(proxy) == "pinned" and mock_stats(fixed)["unpinned_requests"] == 0
    a, b = start_backend(slots=1, **FAST), start_backend(slots=1, **FAST)
    two = start_proxy(a, b, big_threshold_words=None, meta_max=0)
    trust_ram(two)
    for turn in range(QUIET_REQUESTS):
        converse(two, [[], []], turn)
    assert set(two.pipeline.unpinned.state.values()) == {"pinned"}
    assert mock_stats(a)["unpinned_requests"] == mock_stats(b)["unpinned_requests"] == 0


@pytest.mark.parametrize("session", [None, "conte-du-phare"])
def test_a_file_the_server_s_ram_lacks_pins_requests_again_to_restore_it(start_backend: Any, start_proxy: Any,
                                                                          session: str | None) -> None:
    """A long conversation saved while requests were pinned, then restored over (so never copied to the server's
    RAM): once requests go unpinned, its return would be computed again by the server. Its file spares more than
    a switch costs, so requests are pinned again and the file restored."""
    backend = start_backend(slots=2, prefill_ms_per_token=0.2, kv_bytes_per_token=23_040)
    proxy = start_proxy(backend, big_threshold_words=None)
    story = [{"role": "system", "content": "Tu es un conteur. Réponds en français, avec des phrases courtes."},
             {"role": "user", "content": "Raconte l'histoire d'un phare 🗼 au bord de la mer, " * 80}]
    headers = {"X-Session-ID": session} if session else None
    r = proxy.chat(story, headers, max_tokens=6)
    assert r.status_code == 200, r.text
    story.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    proxy.settle()
    assert proxy.records[-1].saved, "a long prompt on a RAM never seen is saved"
    histories: list[list[dict[str, Any]]] = [[], []]
    go_unpinned(proxy, histories)
    before = mock_stats(backend)

    def forget_and_slow() -> None:
        # what a real server shows here: the story was restored over, so its RAM lacks it (`server_cache.gone`),
        # and its prefill is measured at 100 ms a token (a large model on a CPU)
        pipeline = proxy.pipeline
        pipeline.unpinned.server_caches._where.clear()
        pipeline.speeds.of(0, "").prefill.ms_per_token = 100.0
    until(lambda: idle_everywhere(proxy))   # (no answer left to learn a speed from after the one set below)
    on_loop(proxy, forget_and_slow)
    for slot in (0, 1):   # and no slot of the server holds it either
        assert httpx.post(f"{backend.url}/slots/{slot}?action=erase", timeout=10).status_code == 200
    story.append({"role": "user", "content": "Et ensuite ? Une phrase."})
    r = proxy.chat(story, headers, max_tokens=6)
    assert r.status_code == 200, r.text
    proxy.settle()   # its record is kept once the answer is sent: read before, the last one may be the turn before
    record = proxy.records[-1]
    assert record.route == ("session" if session else "restore") and record.restored, (record.route, record.restored)
    assert r.json()["timings"]["cache_n"] > 0.8 * r.json()["usage"]["prompt_tokens"]
    after = mock_stats(backend)
    assert after["restores"] == before["restores"] + 1 and after["pinned_to_busy"] == 0
    assert state(proxy) == "pinned"


def test_a_save_made_only_to_keep_the_ram_s_reach_is_marked_as_such(start_backend: Any, start_proxy: Any) -> None:
    """Pinned, a session's return is restored over what the slot holds: another session's turn, left unsaved since
    the server's RAM serves the returns, and not copied there yet (nothing launched since it ended). The restore
    would take it out of the RAM's reach, so it is saved first (`ram_reach.keeps`); that save is marked on the
    request (`saved_for_ram`) and so does not start the count of quiet requests again (`UnpinnedMode.observe`).
    A save of a cache worth its file is not marked."""
    backend = start_backend(slots=1, prefill_ms_per_token=0.2, kv_bytes_per_token=23_040)
    proxy = start_proxy(backend, big_threshold_words=None)
    story = lighthouse_story(proxy)
    assert proxy.records[-1].saved and not proxy.records[-1].saved_for_ram   # a RAM never seen: worth its file
    r = proxy.chat(user("Hola, ¿qué tal? Una frase, por favor."), {"X-Session-ID": "autre"}, max_tokens=6)
    assert r.status_code == 200, r.text
    proxy.settle()
    assert not proxy.records[-1].saved_for_ram

    def left_to_the_ram() -> None:
        pipeline = proxy.pipeline
        b = pipeline.backends[0]
        now = time.monotonic()
        b.ram.seen(True, now, RAM_SERVED_TOKENS)    # the RAM served a return (so a cache may be left to it) ...
        b.ram.seen(False, now, 0)   # ... and missed one (so the story's file is restored, not left to it)
        slot = pipeline.pool.slots[0]
        assert slot.content is not None and slot.content.session is not None
        slot.content = replace(slot.content, saved=False, keep=False)   # "autre": too short for a file here
        b.launched_at = 0.0      # and nothing launched since it ended: not copied to the RAM yet
        pipeline.speeds.of(0, "").prefill.ms_per_token = 100.0   # a large model on a CPU: the restore pays
    on_loop(proxy, left_to_the_ram)
    before = mock_stats(backend)
    story.append({"role": "user", "content": "Et ensuite ? Une phrase."})
    r = proxy.chat(story, {"X-Session-ID": "phare"}, max_tokens=6)
    assert r.status_code == 200, r.text
    proxy.settle()
    record = proxy.records[-1]
    assert record.restored and record.swap_saved and record.saved_for_ram, (record.restored, record.swap_saved)
    after = mock_stats(backend)
    assert after["saves"] >= before["saves"] + 1 and after["restores"] == before["restores"] + 1


def test_a_request_counts_as_launched_only_once_its_answer_began(start_backend: Any, start_proxy: Any) -> None:
    """llama-server copies its idle slots to RAM when it launches a task, after tokenizing the request: a restore sent
    meanwhile may reach its queue first. So lpcache counts a request as launched (`Backend.launched_at`, what
    `ram_reach.holds` reads) only once its answer began, and then with the time it was sent: while the stand-in still
    computes a long prompt, nothing has changed; once the answer is in, the mark is that request's send."""
    backend = start_backend(slots=2, prefill_ms_per_token=4.0)
    proxy = start_proxy(backend)
    launched = on_loop(proxy, lambda: proxy.pipeline.backends[0].launched_at)
    answers: list[httpx.Response] = []
    sent = time.monotonic()
    thread = threading.Thread(target=lambda: answers.append(proxy.chat(
        user("Summarise this, please: " + "the lighthouse keeper counts ships, gulls and storms; " * 60),
        max_tokens=2)))
    thread.start()
    until(lambda: any(s.get("is_processing") for s in httpx.get(f"{backend.url}/slots").json()), 10)
    assert on_loop(proxy, lambda: proxy.pipeline.backends[0].launched_at) == launched, "counted before its answer"
    thread.join(30)
    assert answers and answers[0].status_code == 200, answers
    now = on_loop(proxy, lambda: proxy.pipeline.backends[0].launched_at)
    assert launched < sent <= now < time.monotonic()


def test_caches_a_restore_took_from_the_ram_are_put_back_before_requests_go_unpinned(start_backend: Any,
                                                                                       start_proxy: Any) -> None:
    """Pinned, a restore replaced a session's turn the server had not copied to its RAM yet (saved to its file first,
    `ram_reach.keeps`). Unpinned, its return would find it nowhere but in that file, so as requests go unpinned its
    file is restored into an idle slot, where the server picks it for that return (the longest common prefix)."""
    backend = start_backend(slots=2, prefill_ms_per_token=0.2, kv_bytes_per_token=23_040)
    proxy = start_proxy(backend, big_threshold_words=None)
    story = lighthouse_story(proxy)
    assert proxy.records[-1].saved   # a RAM never seen: worth its file

    def lost_then_unpinned() -> tuple[int, int]:
        pipeline = proxy.pipeline
        b = pipeline.backends[0]
        held = next(s.content for s in pipeline.pool.slots if s.content is not None)
        assert held is not None and held.saved
        caches = pipeline.saver.server_caches
        caches.held(0, held.chain)
        caches.gone(0, held.chain, held.key)   # what a restore over it would have done
        for slot in pipeline.pool.slots:
            slot.content = None                 # (as if other sessions' turns, copied to the RAM, filled them)
        for _ in range(RAM_TRUST):
            b.ram.seen(True, time.monotonic(), RAM_SERVED_TOKENS)
        pipeline.unpinned._switch(0, "to_unpinned")
        return len(held.chain), len(caches.lost(0))
    before = mock_stats(backend)
    depth, lost = on_loop(proxy, lost_then_unpinned)
    assert lost == 1
    until(lambda: state(proxy) == "unpinned")
    after = mock_stats(backend)
    assert after["restores"] == before["restores"] + 1, (before, after)
    caches = proxy.pipeline.saver.server_caches
    assert on_loop(proxy, lambda: caches.lost(0)) == []
    story.append({"role": "user", "content": "Et ensuite ? Une phrase, s'il te plaît."})
    r = proxy.chat(story, {"X-Session-ID": "phare"}, max_tokens=6)
    assert r.status_code == 200, r.text
    proxy.settle()
    record = proxy.records[-1]
    assert record.route == "unpinned", record.route
    assert record.cache_n is not None and record.prompt_n is not None and record.cache_n > 10 * record.prompt_n, \
        (record.cache_n, record.prompt_n)   # its history came from the slot its file was put back into
