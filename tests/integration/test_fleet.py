"""Several lpcache replicas sharing one cache map through a real Redis (REDIS_URL), in front of stand-ins."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from lpcache import chats
from lpcache.testing import RedisServer
from tests.conftest import Proxy
from tests.integration.conftest import mock_stats


def replicas(start_proxy: Any, backends: list[Any], redis: RedisServer, tmp_path: Any, n: int = 2,
             **settings: Any) -> list[Proxy]:
    return [start_proxy(*backends, redis_url=redis.url, replica_id=f"r{i}", slot_lease_ms=3000,
                        meta_dir=os.path.join(tmp_path, f"meta{i}"), **settings) for i in range(n)]


def conversation_turns(seed: int, turns: int) -> list[dict[str, Any]]:
    """The request bodies of one conversation, each turn carrying the previous answers as the stand-in gave them
    (filled in as they come)."""
    return [chats.request(seed, 300, turns=t + 1) for t in range(turns)]


def test_a_turn_through_the_other_replica_uses_the_cache_the_first_one_left(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    backend = start_backend(slots=2)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path)
    body = chats.request(7, 400)
    first = a.post(body)
    assert first.status_code == 200, first.text
    a.wait_finished(1)
    record_a = a.records[0]
    assert record_a.saved, "turn 1 is big: saved"
    # turn 2 through B: the same prefix and a new user message
    answer = first.json()["choices"][0]["message"]["content"]
    body2 = {**body, "messages": [*body["messages"], {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "And what follows from that, in two lines?"}]}
    second = b.post(body2)
    assert second.status_code == 200, second.text
    b.wait_finished(1)
    record_b = b.records[0]
    assert record_b.cache_hit, record_b
    assert record_b.slot == record_a.slot and record_b.backend == record_a.backend, \
        "B knew from Redis which slot holds the conversation"
    assert record_b.prompt_n is not None and record_b.prompt_n < 0.2 * (record_b.prompt_tokens or 0), record_b


def test_an_entry_saved_by_one_replica_is_restored_by_the_other(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    backend = start_backend(slots=1)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path)
    body = chats.request(11, 400)
    assert a.post(body).status_code == 200
    a.wait_finished(1)
    key = a.records[0].save_file
    assert key is not None
    assert b.run(_wait_for(lambda: key in b.pipeline.index)), "B's mirror has A's entry"
    # another conversation takes the only slot (through B), then the first comes back through B: a restore
    assert b.post(chats.request(12, 400)).status_code == 200
    b.wait_finished(1)
    assert b.post(body).status_code == 200
    b.wait_finished(2)
    record = b.records[1]
    assert record.restored and record.restore_file == key, record
    assert record.cache_hit


def test_concurrent_requests_through_two_replicas_never_share_a_slot(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    for i in range(2):
        os.makedirs(os.path.join(tmp_path, f"slots{i}"), exist_ok=True)
    backends = [start_backend(slots=2, prefill_ms_per_token=0.05, gen_ms_per_token=2.0,
                              slot_save_path=os.path.join(tmp_path, f"slots{i}")) for i in range(2)]
    proxies = replicas(start_proxy, backends, redis_server, tmp_path)
    rng = random.Random(5)
    bodies = [chats.request(100 + i % 6, 200 + 40 * (i % 3)) for i in range(40)]

    def send(i: int) -> int:
        proxy = proxies[rng.randrange(2)]
        with httpx.Client(base_url=proxy.url, timeout=60) as client:
            return client.post("/v1/chat/completions", json=bodies[i]).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(send, range(len(bodies))))
    assert codes == [200] * len(bodies)
    for backend in backends:
        assert mock_stats(backend)["max_concurrent_per_slot"] == 1
    refused = sum(p.pipeline.fleet.stats.claims_refused for p in proxies if p.pipeline.fleet)
    calls = sum(p.pipeline.fleet.stats.redis_calls for p in proxies if p.pipeline.fleet)
    assert calls >= 2 * len(bodies)
    print(f"claims refused (another replica held the slot): {refused}, Redis calls: {calls}")


async def _wait_for(check: Any, timeout: float = 10.0) -> bool:
    import asyncio
    import time

    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True
