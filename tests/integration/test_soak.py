"""Soak: 2,000 chat requests at concurrency 32 through lpcache in front of two stand-ins whose faults are re-armed at
random all along (5xx, error/answer/`/slots`/`/props`/`/health`/save bodies cut or stalled, dropped connections,
stalls, hangs, broken streams, failed saves), with coalescing and the result cache on and two client keys: identical
bodies go at once from both keys, and some clients leave (leaders of coalesced groups among them). See
`lpcache.workloads.soak` for the workload and how answers are judged.

Every answer is this very prompt's answer or an OpenAI-shaped error, never lpcache's own 500; no answer made for one
key reaches the other; afterwards nothing is left busy or waiting, each request made one record, every meta file is
whole, no temporary file is left, and lpcache's memory did not grow from the first quarter to the last.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import tracemalloc
from typing import Any

import httpx
import pytest

from lpcache.backends import llama
from lpcache.workloads.soak import KEYS, Soak, plan

from ..conftest import Proxy, figures, user, words

N_REQUESTS = int(os.environ.get("SOAK_REQUESTS", "2000"))
CONCURRENCY = 32
TIME_LIMIT = 240.0          # seconds for the whole run
MEMORY_LIMIT = 20 * 2**20   # bytes of growth from the end of the first quarter to the end of the last


@pytest.fixture(autouse=True)
def short_error_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled error or info body is given up after half a second (10 s in production)."""
    monkeypatch.setattr(llama, "ERROR_BODY_SECONDS", 0.5)


def soak_proxy(start_backend: Any, start_proxy: Any, tmp_path: Any, slots: int = 4) -> tuple[list[Any], Proxy]:
    backends = [start_backend(slots=slots, gen_ms_per_token=1) for _ in range(2)]
    plugins = ({"name": "result_cache", "params": {"dir": os.path.join(tmp_path, "results"), "ttl_secs": 60,
                                                   "cache_streaming": True}},)
    proxy: Proxy = start_proxy(*backends, request_timeout=2, breaker_cooldown_ms=100, breaker_max_cooldown_ms=800,
                               coalesce_requests=True, api_keys=KEYS, plugins=plugins)
    return backends, proxy


def test_soak_with_random_faults(start_backend: Any, start_proxy: Any, tmp_path: Any) -> None:
    backends, proxy = soak_proxy(start_backend, start_proxy, tmp_path)
    jobs = plan(N_REQUESTS, random.Random(5678))
    soak = Soak(proxy.url, [b.url for b in backends], concurrency=CONCURRENCY, faults=random.Random(1234),
                timeout=TIME_LIMIT)
    mem: list[int] = []

    def memory() -> int:
        proxy.settle()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    async def measure(_: int) -> None:
        mem.append(await asyncio.to_thread(memory))

    tracemalloc.start()
    try:
        report = asyncio.run(soak.run(jobs, measure, parts=4))
    finally:
        tracemalloc.stop()
    records = proxy.records
    figures(f"\nsoak: {report.summary()}")
    figures(f"soak: retries {sum(r.retries for r in records)}, "
            f"coalesced {sum(1 for r in records if r.coalesced)}, "
            f"saved {sum(1 for r in records if r.saved)}, restored {sum(1 for r in records if r.restored)}")
    # Traced memory is the whole test process; it includes the harness's own list of every RequestRecord (~2 KB each).
    figures("soak: traced memory at the end of each quarter (MB): " + ", ".join(f"{m / 2**20:.1f}" for m in mem)
            + f"; growth Q1->Q4 {(mem[-1] - mem[0]) / 2**20:+.1f} MB")

    assert report.seconds < TIME_LIMIT, f"the run took {report.seconds:.0f}s"
    assert not report.problems, f"{len(report.problems)} bad answers, the first ones:\n" + "\n".join(
        report.problems[:10])
    assert report.own_500s() == 0
    assert report.cross_key() == []
    assert report.asked == N_REQUESTS and sum(report.outcomes.values()) == N_REQUESTS
    assert report.outcomes["left"] > 0 and sum(report.armed.values()) > 0
    assert sum(1 for r in records if r.coalesced) > 0, "no request was coalesced"

    proxy.wait_finished(N_REQUESTS)
    assert len(records) == N_REQUESTS, "each request tells the observers exactly once"
    assert proxy.busy_slots() == []
    assert proxy.pipeline.pool.waiting == 0
    for b in backends:   # lpcache closed every upstream it gave up on: no stand-in slot is still generating
        idle = httpx.get(f"{b.url}/mock/wait-idle", params={"timeout": 10}, timeout=20)
        assert idle.status_code == 200, idle.text

    meta_dir = proxy.settings.meta_dir
    metas = [name for name in os.listdir(meta_dir) if name.endswith(".meta.json")]
    assert metas, "no big prompt was saved"
    for name in metas:
        with open(os.path.join(meta_dir, name), "rb") as f:
            doc = json.loads(f.read())
        assert isinstance(doc, dict) and isinstance(doc.get("blocks"), list), name
    folders = [meta_dir, *{b.app_state.config.slot_save_path for b in backends}]
    leftovers = [name for folder in folders for name in os.listdir(folder) if ".tmp-" in name]
    assert leftovers == []

    for i in range(4):   # faults cleared: lpcache serves normally again
        r = proxy.chat(user(words(900_000 + i, 20)), max_tokens=3, headers={"Authorization": f"Bearer {KEYS[i % 2]}"})
        assert r.status_code == 200
    assert mem[-1] - mem[0] < MEMORY_LIMIT, f"memory grew by {(mem[-1] - mem[0]) / 2**20:.1f} MB"
