"""Several requests at once sharing a long prefix (one system prompt, then each its own question): every client gets
its own prompt's answer, with and without faults on the way, and no slot is left busy or waited for.

Two waves: the first finds nothing cached (and saves), the second finds the prefix in slots and files. Two client
keys share the prefix; identical questions asked by both keys at once are not shared across them.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from typing import Any

import httpx
import pytest

from lpcache.backends import llama
from lpcache.workloads.soak import KEYS, Ask, Soak, fault_kinds

from ..conftest import Proxy, words
from .conftest import until

PREFIX = words(77, 300)   # far above big_threshold_words=50: saved, restored, shared
WAVE = 8


@pytest.fixture(autouse=True)
def short_error_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama, "ERROR_BODY_SECONDS", 0.5)


def wave(first: int, seed: int) -> list[list[Ask]]:
    """`WAVE` asks at once: the shared prefix and a question of their own, half streamed; the last two ask the same
    question with the two keys."""
    rng = random.Random(seed)
    asks = [Ask(first + n, n % 2, f"{PREFIX} question {first + n}: " + words(first + n, rng.randint(3, 20)),
                n % 2 == 0, rng.randint(2, 12)) for n in range(WAVE - 2)]
    twin = f"{PREFIX} question both: " + words(first, 5)
    asks += [Ask(first + WAVE - 2, 0, twin, False, 6), Ask(first + WAVE - 1, 1, twin, False, 6)]
    return [asks]   # one job: sent together


@pytest.mark.parametrize("faults", [None, "drop", "break", "status", "error body", "stall", "save body"])
def test_concurrent_requests_sharing_a_long_prefix(start_backend: Any, start_proxy: Any, faults: str | None) -> None:
    backends = [start_backend(slots=3, gen_ms_per_token=2, prefill_ms_per_token=0.05) for _ in range(2)]
    proxy: Proxy = start_proxy(*backends, request_timeout=2, breaker_cooldown_ms=50, breaker_max_cooldown_ms=200,
                               coalesce_requests=True, api_keys=KEYS)
    urls = [b.url for b in backends]
    asked = 0
    for n, first in enumerate([0, 100]):
        if faults is not None:
            arming = fault_kinds(random.Random(n))[faults]()
            assert arming is not None
            httpx.post(f"{urls[n % 2]}/mock/faults", json=arming).raise_for_status()
        report = asyncio.run(Soak(proxy.url, urls, concurrency=WAVE, timeout=60).run(wave(first, n)))
        asked += report.asked
        assert report.problems == [], report.problems
        assert report.own_500s() == 0 and report.cross_key() == []
        if faults is None:
            assert report.outcomes["200"] + report.outcomes["200 stream"] == WAVE, report.summary()
        else:   # failover leaves at most the odd request unanswered
            assert report.outcomes["200"] + report.outcomes["200 stream"] >= WAVE // 2, report.summary()
        for url in urls:
            httpx.delete(f"{url}/mock/faults").raise_for_status()
        proxy.wait_finished(asked)
        assert len(proxy.records) == asked
        assert proxy.busy_slots() == [] and proxy.pipeline.pool.waiting == 0
    if faults is None:   # the second wave found the prefix: in a slot, or restored from a file
        second = proxy.records[WAVE:]
        assert any((r.cache_n or 0) > 200 for r in second), [(r.cache_n, r.restored) for r in second]
    assert os.listdir(proxy.settings.meta_dir), "the prefix was saved"


def test_a_request_sent_while_a_slot_saves_the_prefix_it_shares_restores_that_file(start_backend: Any,
                                                                                    start_proxy: Any) -> None:
    """A's answer is over and slot 0 saves its cache (slowly); C, sharing the prefix, waits for slot 0 (one request
    waits for a slot, not several). B, sharing it too and sent then, finds no file yet and slot 0 spoken for: it
    takes slot 1, waits for slot 0's save and restores that file, rather than computing the prefix beside C."""
    backend = start_backend(slots=2, prefill_ms_per_token=10.0, gen_ms_per_token=1.0)
    proxy: Proxy = start_proxy(backend)
    slot0 = proxy.pipeline.pool.slots[0]

    def ask(text: str) -> threading.Thread:
        thread = threading.Thread(target=proxy.chat, args=([{"role": "user", "content": f"{PREFIX} {text}"}],),
                                  kwargs={"max_tokens": 4})
        thread.start()
        return thread

    httpx.post(f"{backend.url}/mock/faults", json={"latency_ms": 1500, "paths": ["/slots/0"]}).raise_for_status()
    a = ask("question A: " + words(1, 8))
    until(lambda: slot0.busy and slot0.phase == "save")        # A's answer is over: its save is under way
    c = ask("question C: " + words(3, 8))
    until(lambda: slot0.awaited)                                # C waits for slot 0
    b = ask("question B: " + words(2, 8))
    for thread in (a, b, c):
        thread.join()
    proxy.wait_finished(3)
    first, *rest = proxy.records
    mine = next(r for r in rest if r.slot == 1)
    assert first.slot == 0 and first.saved is True
    assert mine.restored is True and mine.cache_n and mine.cache_n >= 300, "B restored A's file"
    assert mine.prompt_n is not None and mine.prompt_n < 40
