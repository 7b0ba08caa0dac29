"""A property over random fault schedules (hypothesis): whatever faults the stand-ins are given, in whatever order,
between tens of requests from two client keys (identical bodies at once, clients that leave), lpcache ends every run
with no busy slot and nobody waiting, one record per request, every client answer well-formed (this prompt's
answer, or an OpenAI-shaped error: never lpcache's own 500), and no answer made for one key given to the other.

One lpcache in front of two stand-ins for the whole run (hypothesis cannot use function-scoped fixtures per
example), coalescing and the result cache on; each example arms its schedule's faults one by one, a part of its
requests after each, then disarms them all and checks.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lpcache.backends import llama
from lpcache.config import BackendConfig, Settings
from lpcache.mock_llama import MockConfig, MockHandle, start_mock
from lpcache.workloads.soak import KEYS, WEIGHTS, Soak, arm, fault_kinds, plan

from ..conftest import Proxy

EXAMPLES = 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[MockHandle], Proxy]]:
    root = tmp_path_factory.mktemp("schedules")
    slot_dir = os.path.join(root, "slots")
    os.makedirs(slot_dir)
    mocks = [start_mock(MockConfig(slots=2, slot_save_path=slot_dir, gen_ms_per_token=1)) for _ in range(2)]
    proxy: Proxy | None = None
    plugins = ({"name": "result_cache", "params": {"dir": os.path.join(root, "results"), "cache_streaming": True}},)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(llama, "ERROR_BODY_SECONDS", 0.5)   # a stalled error or info body: given up soon
            proxy = Proxy(Settings(
                backends=tuple(BackendConfig(m.url, None, slot_dir) for m in mocks),
                meta_dir=os.path.join(root, "meta"), host="127.0.0.1", save_retry_delay_ms=10,
                big_threshold_words=50, words_per_block=10, request_timeout=1.0, breaker_cooldown_ms=50,
                breaker_max_cooldown_ms=200, coalesce_requests=True, api_keys=KEYS, plugins=plugins))
            yield mocks, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        for m in mocks:
            m.stop()


schedules = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(sorted(WEIGHTS)), st.integers(0, 2**16)),
                     min_size=1, max_size=5)


def test_every_fault_schedule_ends_clean(servers: tuple[list[MockHandle], Proxy]) -> None:
    mocks, proxy = servers
    urls = [m.url for m in mocks]
    runs: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(schedule=schedules, n=st.integers(10, 40), seed=st.integers(0, 2**32 - 1))
    def run(schedule: list[tuple[int, str, int]], n: int, seed: int) -> None:
        before = len(proxy.records)

        async def arm_step(k: int) -> None:
            if k < len(schedule):
                backend, kind, fault_seed = schedule[k]
                faults = fault_kinds(random.Random(fault_seed))[kind]()
                async with aiohttp.ClientSession() as http:
                    await arm(http, urls[backend], faults)

        async def go() -> Any:
            await arm_step(0)
            soak = Soak(proxy.url, urls, concurrency=8, timeout=30)
            return await soak.run(plan(n, random.Random(seed), leave=0.15), lambda k: arm_step(k + 1),
                                  parts=len(schedule))

        report = asyncio.run(go())
        for url in urls:
            httpx.delete(f"{url}/mock/faults").raise_for_status()
        runs.append(report.summary())
        assert report.problems == [], report.problems[:5]
        assert report.own_500s() == 0
        assert report.cross_key() == []
        assert report.asked == n
        proxy.wait_finished(before + n)
        assert len(proxy.records) == before + n, "one record per request"
        assert proxy.busy_slots() == []
        assert proxy.pipeline.pool.waiting == 0
        for url in urls:   # nothing still generating on the stand-ins either
            assert httpx.get(f"{url}/mock/wait-idle", params={"timeout": 10}, timeout=20).status_code == 200

    run()
    print("\n" + "\n".join(runs))
    assert len(runs) >= EXAMPLES
