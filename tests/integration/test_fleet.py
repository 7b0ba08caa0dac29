"""Several lpcache replicas sharing one cache map through a real Redis (REDIS_URL), in front of stand-ins."""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from lpcache.workloads import chats
from lpcache.workloads.harness import RedisServer
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
    slot = next(s for s in b.pipeline.pool.slots if s.id == record_a.slot)
    assert b.run(_wait_for(lambda: slot.content is not None and slot.content.saved and not slot.taken)), \
        "B's mirror has what A left in the slot"
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


def test_a_claim_tells_the_other_replicas_the_file_its_save_will_write(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    """While replica A's request runs, replica B knows the name A's save will write (the prefix cache's file: the
    prompt's key and the model's identity, not the key alone), so B's limits keep that name while llama-server
    writes it."""
    backend = start_backend(slots=1, gen_ms_per_token=40.0)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path)
    body = {**chats.request(21, 400), "max_tokens": 30}
    slot = b.pipeline.pool.slots[0]
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=a.url, timeout=60) as client:
        answer = pool.submit(client.post, "/v1/chat/completions", json=body)
        assert b.run(_wait_for(lambda: slot.elsewhere is not None and slot.pending is not None))
        announced = b.pipeline.fleet.files_in_use()
        assert answer.result().status_code == 200
    a.wait_finished(1)
    saved = a.records[0].save_file
    assert saved is not None and announced == {saved}, (announced, saved)


def test_an_idle_save_tells_the_other_replicas_the_file_it_writes(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    """lpcache's own save of an idle slot (SAVE_IDLE_SECONDS; also at shutdown and before a router unloads) holds
    the slot's lease like a request: the other replicas are told the file it writes, so their limits keep it."""
    backend = start_backend(slots=1)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path, save_policy="evict", save_idle_seconds=0.2)
    assert a.post(chats.request(31, 400)).status_code == 200
    a.wait_finished(1)
    [slot_a] = a.pipeline.pool.slots
    held = slot_a.content
    assert held is not None and not held.saved
    httpx.post(f"{backend.url}/mock/faults", json={"latency_ms": 1500, "paths": [f"/slots/{slot_a.id}"]})
    slot = b.pipeline.pool.slots[0]
    assert b.run(_wait_for(lambda: slot.elsewhere is not None and slot.pending is not None))
    announced = b.pipeline.fleet.files_in_use()
    assert a.run(_wait_for(lambda: slot_a.content is not None and slot_a.content.saved))
    assert announced == {held.key} and held.key in a.pipeline.index, (announced, held.key)


async def _wait_for(check: Any, timeout: float = 10.0) -> bool:
    import asyncio
    import time

    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True


def test_a_backend_whose_folder_lpcache_cannot_see_keeps_ring_files_at_most(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any, slot_dir: str) -> None:
    from lpcache.config import BackendConfig
    from lpcache.fleet.replica import ring_file

    backend = start_backend(slots=1)
    remote = BackendConfig(backend.url, None, None)   # lpcache is not told the folder: as on another host
    a, b = [start_proxy(remote, redis_url=redis_server.url, replica_id=f"r{i}", ring_files=3,
                        meta_dir=os.path.join(tmp_path, f"meta{i}")) for i in range(2)]
    ring = {ring_file(backend.url, i) for i in range(3)}
    bodies = [chats.request(200 + i, 300) for i in range(7)]
    for i, body in enumerate(bodies):
        proxy = (a, b)[i % 2]
        assert proxy.post(body).status_code == 200
        proxy.settle()
    on_disk = {name for name in os.listdir(slot_dir) if len(name) == 64}
    assert on_disk <= ring and len(on_disk) == 3, on_disk
    for proxy in (a, b):
        assert proxy.run(_wait_for(lambda p=proxy: set(p.pipeline.index._entries) <= ring
                                   and len(p.pipeline.index) == 3)), sorted(proxy.pipeline.index._entries)
    # the last one saved is restored through the other replica after another prompt took the slot
    assert a.post(chats.request(300, 300)).status_code == 200
    a.settle()
    assert b.post(bodies[-1]).status_code == 200
    b.settle()
    last = b.records[-1]
    assert last.restored and last.restore_file in ring and last.cache_hit, last


def test_replicas_serve_while_redis_is_down_and_share_again_once_it_is_back(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    backend = start_backend(slots=2)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path)
    assert a.post(chats.request(400, 300)).status_code == 200
    a.settle()
    redis_server.kill()   # gone with its data
    for i in range(6):
        proxy = (a, b)[i % 2]
        r = proxy.post(chats.request(410 + i % 3, 300))
        assert r.status_code == 200, r.text
        proxy.settle()
    fleets = [p.pipeline.fleet for p in (a, b)]
    assert all(f is not None and not f.healthy for f in fleets)
    assert sum(f.stats.local_claims for f in fleets if f) >= 1
    metrics = a.client.get("/metrics").text
    assert "lpcache_redis_up 0.0" in metrics
    redis_server.restart()   # empty: each replica writes again what it knows
    assert a.run(_wait_for(lambda: fleets[0].healthy, 20)) and b.run(_wait_for(lambda: fleets[1].healthy, 20))
    saved_by_a = {r.save_file for r in a.records if r.saved}
    assert b.run(_wait_for(lambda: saved_by_a <= set(b.pipeline.index._entries), 20)), \
        "A's entries are in B's mirror again"
    body = chats.request(400, 300)
    assert b.post(chats.request(420, 300)).status_code == 200
    b.settle()
    r = b.post(body)
    assert r.status_code == 200
    b.settle()
    assert b.records[-1].cache_hit, b.records[-1]
    assert "lpcache_redis_up 1.0" in a.client.get("/metrics").text


def test_a_replica_killed_mid_request_frees_its_slot_within_the_lease_and_the_retry_is_served(
        redis_server: RedisServer, tmp_path: Any) -> None:
    import json
    import threading

    from lpcache.workloads.harness import LpcacheProcess, MockProcess

    folder = os.path.join(tmp_path, "slots")
    os.makedirs(folder)
    mock = MockProcess(folder, n_slots=1, extra=["--gen-ms-per-token", "40"])
    common = {"BACKENDS": json.dumps([{"url": mock.url, "slot_save_path": folder}]), "REDIS_URL": redis_server.url,
              "SLOT_LEASE_MS": "2000", "BIG_THRESHOLD_WORDS": "50", "WORDS_PER_BLOCK": "10", "LOG_LEVEL": "INFO"}
    a = LpcacheProcess({**common, "REPLICA_ID": "a", "META_DIR": os.path.join(tmp_path, "meta-a")})
    b = LpcacheProcess({**common, "REPLICA_ID": "b", "META_DIR": os.path.join(tmp_path, "meta-b")})
    try:
        long = {**chats.request(500, 300), "max_tokens": 400, "stream": True}
        first_chunk = threading.Event()

        def stream_through_a() -> None:
            try:
                with httpx.stream("POST", a.url + "/v1/chat/completions", json=long, timeout=60) as r:
                    for _ in r.iter_bytes():
                        first_chunk.set()
            except httpx.HTTPError:
                pass   # its replica is killed under it

        reader = threading.Thread(target=stream_through_a)
        reader.start()
        assert first_chunk.wait(30), a.log_tail()
        assert a.process is not None
        a.process.kill()   # kill -9, its lease held
        a.process.wait()
        reader.join(30)
        # the client's retry through B: the only slot is A's until its lease lapses, then B's
        retry = httpx.post(b.url + "/v1/chat/completions", json={**long, "stream": False, "max_tokens": 8},
                           timeout=60)
        assert retry.status_code == 200, retry.text
        assert "Traceback" not in b.log_text() and "internal_error" not in b.log_text(), b.log_tail()
        # nothing half-indexed: every entry in Redis names a file that is there
        import redis as redis_sync

        client = redis_sync.Redis.from_url(redis_server.url)
        for key in client.hkeys("lpcache:map:index"):
            assert os.path.exists(os.path.join(folder, key.decode())), key
    finally:
        b.stop()
        a.stop()
        mock.stop()


def test_a_slot_whose_holder_died_mid_request_is_not_believed_to_hold_anything(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    backend = start_backend(slots=1)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path)
    body = chats.request(600, 300)
    assert a.post(body).status_code == 200
    a.settle()
    slot_b = b.pipeline.pool.slots[0]
    assert b.run(_wait_for(lambda: slot_b.content is not None and not slot_b.taken))
    # A takes the slot's lease again and dies holding it: no renewal, no release, no word of what it left
    fleet_a, slot_a = a.pipeline.fleet, a.pipeline.pool.slots[0]
    assert fleet_a is not None and a.run(fleet_a.claim(slot_a, None))
    held = fleet_a._held.pop(slot_a)
    held.stop.set()
    # B's next request for the same conversation: the slot comes free when the lease lapses; B does not trust
    # what it believed the slot held (A's request may have replaced it), so the saved file is restored
    r = b.post(body)
    assert r.status_code == 200, r.text
    b.settle()
    record = b.records[-1]
    assert record.restored and record.cache_hit, record


def test_the_result_cache_is_shared_through_redis(start_backend: Any, start_proxy: Any,
                                                  redis_server: RedisServer, tmp_path: Any) -> None:
    from lpcache.config import load_settings

    backend = start_backend(slots=1)
    specs = load_settings([], {"REDIS_URL": redis_server.url, "PLUGINS": json.dumps(
        [{"name": "result_cache", "params": {"dir": str(tmp_path / "results"), "ttl_secs": 60}}])}).plugins
    assert specs[0]["params"]["redis_url"] == redis_server.url, "REDIS_URL reaches the result cache"
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path, plugins=specs)
    body = {**chats.request(700, 60), "temperature": 0}
    first = a.post(body)
    assert first.status_code == 200
    a.wait_finished(1)
    second = b.post(body)
    assert second.status_code == 200
    b.wait_finished(1)
    assert b.records[0].prefilter == "result_cache:serve", b.records[0]
    assert second.json()["choices"] == first.json()["choices"]
    assert not os.path.exists(tmp_path / "results") or not os.listdir(tmp_path / "results")


async def test_fleet_claims_never_give_one_slot_to_two_valid_holders(redis_server: RedisServer, tmp_path: Any) -> None:
    """Many requests of four replicas' claims on two slots, with random work, crashes (no release, no renewal) and
    stalls (renewals stopped, work going on): whenever a claim succeeds, no other replica holds a valid lease on that
    slot, and each slot accepts writes in token order (a holder writes only while its lease is valid)."""
    import asyncio

    from lpcache.backends.slot_pool import SlotPool
    from lpcache.backends.slots import Slot
    from lpcache.cache.index import MetaIndex
    from lpcache.cache.sessions import SessionBook
    from lpcache.cache.speeds import SpeedBook
    from lpcache.fleet.replica import Fleet

    rng = random.Random(7)
    fleets = []
    for i in range(4):
        pool = SlotPool([Slot(0, n, url="http://b:8080") for n in range(2)])
        index = MetaIndex(str(tmp_path / f"meta{i}"), 10, 10)
        fleet = Fleet(redis_server.url, f"r{i}", 150, [], pool, index, SessionBook(), SpeedBook(),
                      lambda c: asyncio.ensure_future(c))
        await fleet.start()
        fleets.append(fleet)
    written: dict[str, list[int]] = {"http://b:8080#0": [], "http://b:8080#1": []}
    counts = {"claimed": 0, "refused": 0, "crashed": 0, "stalled": 0, "stopped writing": 0}

    async def request(i: int) -> None:
        fleet = fleets[i % 4]
        await asyncio.sleep(rng.uniform(0, 1.0))
        while True:
            idle = [s for s in fleet.pool.slots if not s.busy]
            if idle:
                slot = rng.choice(idle)
                slot.busy = True
                if await fleet.claim(slot):
                    break
                slot.busy = False
                counts["refused"] += 1
            await asyncio.sleep(rng.uniform(0.005, 0.02))
        counts["claimed"] += 1
        mine = fleet._held[slot].lease
        for other in fleets:
            if other is not fleet:
                theirs = next((h.lease for s, h in other._held.items() if s.name == slot.name), None)
                assert theirs is None or not theirs.valid(), f"{slot.name}: {theirs} valid beside {mine}"
        mode = rng.choice(["work", "work", "work", "crash", "stall"])
        held = fleet._held[slot]
        if mode in ("crash", "stall"):
            if held.renewals is not None:
                held.renewals.cancel()
            held.stop.set()
        for _ in range(rng.randint(1, 8)):
            await asyncio.sleep(rng.uniform(0.01, 0.06))
            if mode == "crash":
                break
            if not fleet.valid(slot):
                counts["stopped writing"] += 1
                break
            log = written[slot.name]
            assert not log or mine.token >= log[-1], f"{slot.name}: token {mine.token} after {log[-1]}"
            log.append(mine.token)
        if mode == "crash":
            counts["crashed"] += 1
            fleet._held.pop(slot)
            slot.busy = False   # this replica is gone as far as the slot is concerned: its lease lapses
        else:
            counts["stalled"] += mode == "stall"
            fleet.pool.release(slot)

    try:
        await asyncio.wait_for(asyncio.gather(*(request(i) for i in range(60))), 60)
    finally:
        for fleet in fleets:
            await fleet.stop()
    print(counts)
    assert counts["claimed"] == 60 and counts["refused"] > 0 and counts["crashed"] > 0


async def _fleets(redis: RedisServer, tmp_path: Any, n: int, ttl_ms: int = 3000,
                  folder: str | None = None, servers: int = 1) -> list[Any]:
    """`n` replicas' Fleet objects on `servers` backends of two slots each (`folder`: the first one's slot-save
    folder as lpcache sees it; None: on another host; the others' folders are their own), started."""
    import asyncio
    from types import SimpleNamespace

    from lpcache.backends.slot_pool import SlotPool
    from lpcache.backends.slots import Slot
    from lpcache.cache.index import MetaIndex
    from lpcache.cache.sessions import SessionBook
    from lpcache.cache.speeds import SpeedBook
    from lpcache.fleet.replica import Fleet

    fleets = []
    for i in range(n):
        backends = [SimpleNamespace(index=k, url=f"http://b:{8080 + k}", suspect=False,
                                    config=SimpleNamespace(slot_save_path=folder if k == 0 else f"/slots{k}"))
                    for k in range(servers)]
        pool = SlotPool([Slot(b.index, s, url=b.url) for b in backends for s in range(2)])
        fleet = Fleet(redis.url, f"r{i}", ttl_ms, backends, pool,   # type: ignore[arg-type]
                      MetaIndex(str(tmp_path / f"meta{i}"), 10, 10), SessionBook(), SpeedBook(),
                      lambda c: asyncio.ensure_future(c), ring_files=4)
        await fleet.start()
        fleets.append(fleet)
    return fleets


def _state(redis: RedisServer, name: str) -> dict[str, Any]:
    import redis as redis_sync

    raw = redis_sync.Redis.from_url(redis.url).hget("lpcache:map:slots", name)
    assert raw is not None, name
    return json.loads(raw.decode().partition(":")[2])  # type: ignore[no-any-return]


async def test_a_claim_the_client_sent_again_after_a_lost_answer_is_its_own_grant(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """redis-py sends a call again on a new connection when the first one's answer was lost: the claim script,
    run twice for one holder, grants the slot to that holder both times (not a refusal that leaves the slot
    leased to nobody who knows it), and what the slot held is then unknown (the first run's reading is lost)."""
    from lpcache.fleet.leases import Holder
    from lpcache.fleet.slot_state import trusted as _trusted

    (fleet,) = await _fleets(redis_server, tmp_path, 1)
    try:
        slot = fleet.pool.slots[0]
        holder = Holder("r0", "7")
        first = await fleet._claim_call(slot, holder, None)
        again = await fleet._claim_call(slot, holder, None)
        assert int(first[0]) > 0 and int(again[0]) == int(first[0])
        assert _trusted(again[1].decode(), again[2].decode()) is None, "its own busy state: unknown"
        other = await fleet._claim_call(slot, Holder("r0", "8"), None)
        assert int(other[0]) == 0 and int(other[1]) > 0, "another request of the same replica is refused"
    finally:
        await fleet.stop()


async def test_a_granted_claim_whose_request_left_gives_the_slot_back_as_it_found_it(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """The client of a claim left (cancelled) while Redis granted it: the lease goes at once and the slot's state
    is the one the claim found, not "busy" (which would make every other replica wait for the lease's ttl)."""
    import asyncio

    from lpcache.backends.slots import Content
    from lpcache.fleet.leases import PREFIX, Holder

    a, b = await _fleets(redis_server, tmp_path, 2)
    try:
        slot_a, slot_b = a.pool.slots[0], b.pool.slots[0]
        slot_a.busy = True
        assert await a.claim(slot_a)
        slot_a.content = Content("k" * 64, (1, 2, 3), saved=True, model="m", tokens=40)
        a.pool.release(slot_a, True)
        assert await _wait_for(lambda: slot_b.content is not None and slot_b.content.key == "k" * 64)
        call = asyncio.ensure_future(b._claim_call(slot_b, Holder("r1", "x"), None))
        await call
        assert _state(redis_server, slot_b.name)["busy"], "the claim wrote the slot busy"
        b._give_back_granted(call, slot_b, Holder("r1", "x"), 0.0)
        assert slot_b.name in b._releasing
        assert await _wait_for(lambda: slot_b.name not in b._releasing)
        state = _state(redis_server, slot_b.name)
        assert not state.get("busy") and state["content"]["key"] == "k" * 64, state
        import redis as redis_sync

        assert not redis_sync.Redis.from_url(redis_server.url).exists(PREFIX + slot_b.name), "lease deleted"
        assert await _wait_for(lambda: slot_a.elsewhere is None and slot_a.content is not None)
        slot_a.busy = True
        assert await a.claim(slot_a), "the slot is free for the other replica at once"
        assert slot_a.content is not None and slot_a.content.key == "k" * 64
        a.pool.release(slot_a, True)
    finally:
        await a.stop()
        await b.stop()


async def test_slots_used_without_a_lease_while_redis_was_down_are_unknown_once_it_is_back(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """While Redis is down a replica takes slots on its own word; another may have done the same. Once Redis is
    back, the slot's shared state says "unknown" under a new token (every replica stops believing what it held),
    and the replica that used it asks the server (its backend is suspect) before trusting its own belief."""
    from lpcache.backends.slots import Content

    a, b = await _fleets(redis_server, tmp_path, 2)
    try:
        slot_a, slot_b = a.pool.slots[1], b.pool.slots[1]
        slot_a.busy = True
        assert await a.claim(slot_a)
        slot_a.content = Content("c" * 64, (4, 5), saved=True, model="m", tokens=30)
        a.pool.release(slot_a, True)
        assert await _wait_for(lambda: slot_b.content is not None)
        before = _state(redis_server, slot_a.name)["token"]
        redis_server.kill()
        assert await _wait_for(lambda: a.map.down and b.map.down, 20)
        slot_a.busy = True
        assert await a.claim(slot_a) and a.stats.local_claims == 1, "a local decision"
        slot_a.content = Content("d" * 64, (6,), model="m", tokens=12)
        a.pool.release(slot_a, True)
        assert slot_a in a._unleased
        redis_server.restart()
        assert await _wait_for(lambda: not a.map.down and not a._unleased and slot_a.name not in a._releasing, 20)
        assert a.backends[0].suspect, "A checks the server before trusting what it believes"
        assert await _wait_for(lambda: b.healthy and slot_b.content is None, 20), slot_b.content
        state = _state(redis_server, slot_a.name)
        assert state["content"] is None and not state.get("busy") and state["token"] > before, state
    finally:
        await a.stop()
        await b.stop()


async def test_the_ring_passes_over_names_in_use_and_names_none_while_redis_is_down(
        redis_server: RedisServer, tmp_path: Any) -> None:
    import pytest

    from lpcache.backends.slots import Content
    from lpcache.errors import SharedStoreDown
    from lpcache.fleet.replica import ring_file

    (fleet,) = await _fleets(redis_server, tmp_path, 1)
    try:
        backend = fleet.backends[0]
        url = backend.url
        ring = [ring_file(url, i) for i in range(4)]
        fleet.pool.slots[0].content = Content(ring[1], (1,), saved=True, model="m")   # a slot holds that file
        fleet.index.protect(ring[2])                                                # a restore chose that one
        names = [await fleet.ring_name(backend) for _ in range(8)]
        assert set(names) == {ring[0], ring[3]}, names
        fleet.pool.slots[1].content = Content(ring[0], (2,), saved=True, model="m")
        fleet.index.protect(ring[3])
        with pytest.raises(SharedStoreDown, match="in use"):
            await fleet.ring_name(backend)
        fleet.index.unprotect(ring[3])
        redis_server.kill()
        assert await _wait_for(lambda: fleet.map.down, 20)
        calls = fleet.stats.redis_calls
        with pytest.raises(SharedStoreDown, match="unreachable"):
            await fleet.ring_name(backend)
        assert fleet.stats.redis_calls == calls, "no call to a Redis known to be down"
        redis_server.restart()
    finally:
        await fleet.stop()


async def test_the_shared_session_documents_are_bounded(redis_server: RedisServer, tmp_path: Any,
                                                        monkeypatch: Any) -> None:
    from lpcache.fleet import publishing as fleet_module

    monkeypatch.setattr(fleet_module, "SESSIONS_SHARED", 20)
    (fleet,) = await _fleets(redis_server, tmp_path, 1)
    try:
        for i in range(40):
            info = fleet.sessions.known(f"session-file-{i}", f"user {i} ✓", "m", None)
            info.saved_chain = (i, i + 1)
            fleet.session_saved(info)
            assert await _wait_for(lambda i=i: fleet.map.get("sessions", f"session-file-{i}") is not None
                                   and not fleet._pruning)
        kept = {key for key, _ in fleet.map.items("sessions")}
        assert 20 <= len(kept) <= 22, len(kept)
        assert "session-file-39" in kept and "session-file-0" not in kept, "the least recently saved went"
        import redis as redis_sync

        assert redis_sync.Redis.from_url(redis_server.url).hlen("lpcache:map:sessions") == len(kept)
    finally:
        await fleet.stop()


def test_bad_input_cut_bodies_and_clients_that_leave_never_leave_a_slot_leased(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any) -> None:
    """Through two replicas on one one-slot server: bad bodies get OpenAI's error shape, a backend that cuts its
    answer halfway and a client that leaves mid-stream end their request; after each, the slot's lease is gone and
    its shared state is not "busy", so the other replica's next request takes the only slot at once (no claim of it
    refused: no wait for the lease to lapse)."""
    import redis as redis_sync

    from lpcache.fleet.leases import PREFIX

    backend = start_backend(slots=1, gen_ms_per_token=5.0)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path, request_timeout=5.0)
    client = redis_sync.Redis.from_url(redis_server.url)
    slot_name = a.pipeline.pool.slots[0].name
    sent = [0]   # requests sent to A

    def nothing_held(proxy: Proxy) -> None:
        proxy.wait_finished(sent[0])   # the request is over (a client that left: once lpcache saw it go)
        proxy.settle()
        assert proxy.busy_slots() == []
        assert b.run(_wait_for(lambda: not client.exists(PREFIX + slot_name))), "the lease was given back"
        state = client.hget("lpcache:map:slots", slot_name)   # none yet: no request claimed the slot
        assert state is None or not json.loads(state.decode().partition(":")[2]).get("busy"), state
        refused = b.pipeline.fleet.stats.claims_refused
        r = b.post({**chats.request(800, 60), "max_tokens": 4})
        assert r.status_code == 200, r.text
        b.settle()
        assert b.pipeline.fleet.stats.claims_refused == refused, "the other replica took the slot at once"

    for raw in (b"{not json", b'{"messages": "hello"}', json.dumps(
            {"messages": [{"role": "user", "content": "ünïcode ✓ `code`"}], "max_tokens": -3}).encode()):
        r = a.client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        sent[0] += 1
        assert r.status_code in (400, 422), (raw, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "code"} and err["type"] == "invalid_request_error", err
    nothing_held(a)
    # the backend cuts its answer halfway, streamed and not: before anything went to the client (its one slot
    # failed, nothing is left to try: 502), or after a stream's first events (it ends with an error event)
    cut_first = {"body_cut": 1}
    cut_later = {"stream_break_after": 2, "stream_break_count": 1, "stream_break_half": True}
    for stream, faults in ((False, cut_first), (True, cut_first), (True, cut_later)):
        httpx.post(f"{backend.url}/mock/faults", json=faults).raise_for_status()
        r = a.client.post("/v1/chat/completions", json={**chats.request(801, 200), "max_tokens": 40,
                                                        "stream": stream})
        sent[0] += 1
        assert "Traceback" not in r.text
        if faults is cut_later:
            assert r.status_code == 200 and "error" in r.text, r.text[-300:]
        else:
            assert r.status_code == 502 and r.json()["error"]["type"], r.text
        nothing_held(a)
    # a client that leaves mid-stream
    with httpx.stream("POST", a.url + "/v1/chat/completions", timeout=30,
                      json={**chats.request(802, 200), "max_tokens": 200, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
    sent[0] += 1
    nothing_held(a)


async def test_index_changes_made_together_are_one_write_and_a_long_save_is_told(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """A new index entry and the ones the limits removed for it go to Redis in one call; the save phase of a slot
    is told to the other replicas only once the save lasts (the release of a quick one says it all)."""
    a, b = await _fleets(redis_server, tmp_path, 2)
    try:
        await a.map.put("index", "old-entry", b'{"key": "old-entry"}')
        assert await _wait_for(lambda: b.map.get("index", "old-entry") is not None)
        calls = a.stats.redis_calls
        a.entry_changed("new-entry", b'{"key": "new-entry"}')
        a.entry_changed("old-entry", None)
        assert await _wait_for(lambda: not a._index_out and b.map.get("index", "new-entry") is not None
                               and b.map.get("index", "old-entry") is None)
        assert a.stats.redis_calls == calls + 1, "one round trip for both changes"

        slot = a.pool.slots[0]
        slot.busy = True
        assert await a.claim(slot)
        a.saving(slot)            # a quick save: released before SAVE_TOLD_AFTER
        timer = a._held[slot].save_told
        a.pool.release(slot, True)
        assert timer is not None and timer.cancelled()
        slot.busy = True
        assert await a.claim(slot)
        a.saving(slot)            # a long one: told
        assert await _wait_for(lambda: _state(redis_server, slot.name).get("phase") == "save")
        other = b.pool.slots[0]
        assert await _wait_for(lambda: other.phase == "save" and other.elsewhere == "r0")
        a.pool.release(slot, True)
        assert await _wait_for(lambda: other.elsewhere is None and not other.phase)
    finally:
        await a.stop()
        await b.stop()


async def test_a_slot_given_back_is_taken_over_by_the_replicas_next_request_without_a_round_trip(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """An agent's next turn comes the moment the answer ends: its request takes the slot over from the one that
    just gave it back (same lease, no Redis call on its way); the others see the slot busy until the lease goes
    HANDOVER seconds after the last request gave it back, with what that one left in it."""
    import redis as redis_sync

    from lpcache.backends.slots import Content
    from lpcache.fleet.leases import PREFIX

    a, b = await _fleets(redis_server, tmp_path, 2)
    client = redis_sync.Redis.from_url(redis_server.url)
    try:
        slot, theirs = a.pool.slots[0], b.pool.slots[0]
        slot.busy = True
        assert await a.claim(slot)
        token = a._held[slot].lease.token
        slot.content = Content("e" * 64, (1, 2), saved=True, model="m", tokens=20)
        a.pool.release(slot, True)
        calls = a.stats.redis_calls
        slot.busy = True
        assert await a.claim(slot) and a.stats.handovers == 1
        assert a.stats.redis_calls == calls, "no round trip on the request's way"
        assert a._held[slot].lease.token == token and client.get(PREFIX + slot.name).decode().startswith(str(token))
        theirs.busy = True
        assert not await b.claim(theirs), "still this replica's"
        theirs.busy = False
        slot.content = Content("f" * 64, (1, 2, 3), saved=True, model="m", tokens=30)
        a.pool.release(slot, True)
        assert await _wait_for(lambda: not client.exists(PREFIX + slot.name) and slot.name not in a._releasing)
        state = _state(redis_server, slot.name)
        assert state["token"] == token and state["content"]["key"] == "f" * 64 and not state.get("busy"), state
        assert await _wait_for(lambda: theirs.elsewhere is None and theirs.content is not None
                               and theirs.content.key == "f" * 64)
        theirs.busy = True
        assert await b.claim(theirs) and theirs.content is not None and theirs.content.key == "f" * 64
        b.pool.release(theirs, True)
    finally:
        await a.stop()
        await b.stop()


async def test_the_files_another_replicas_request_restores_or_saves_are_never_deleted_by_the_limits(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """Replica A's request restores a saved cache into a slot and will save its own prompt from it; replica B's
    limits bite meanwhile (a save of its own past META_MAX): B deletes neither file (it would unlink the file A's
    server is reading, or the one it is writing). Once A gives the slot back, they count as any other."""
    from dataclasses import replace

    from lpcache.backends.placement import Want
    from lpcache.cache.meta_files import prefix_file
    from lpcache.cache.prefix import Prompt

    folder = tmp_path / "slots"
    folder.mkdir()

    def prompt(tag: str) -> Prompt:
        words = " ".join(f"{tag}{i}, «Ünïcode» `code_{i}()`" for i in range(60))
        p = Prompt.of("m", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words}], 10)
        return replace(p, exact=p.chain)

    def file(p: Prompt) -> str:   # the name a save of it writes (as `saving.cache_file`): key and model
        return prefix_file(p.key, "fp")

    a, b = await _fleets(redis_server, tmp_path, 2, folder=str(folder))
    try:
        restored, saved, other = prompt("restored"), prompt("saved"), prompt("other")
        for p in (restored, saved):
            (folder / file(p)).write_bytes(b"kv")
        await a.index.add(restored, file(restored), "http://b:8080", str(folder), "fp")
        assert await _wait_for(lambda: file(restored) in b.index)
        await b.index.add(saved, file(saved), "http://b:8080", str(folder), "fp")   # an older save of A's prompt
        slot_a, slot_b = a.pool.slots[0], b.pool.slots[0]
        slot_a.busy = True
        assert await a.claim(slot_a, Want(saved, file_of=lambda slot: file(saved)), restore=file(restored))
        assert await _wait_for(lambda: slot_b.elsewhere == "r0" and slot_b.restoring == file(restored))
        assert b.files_in_use() == {file(restored), file(saved)}
        b.index.meta_max = 1
        (folder / file(other)).write_bytes(b"kv")
        removed = await b.index.add(other, file(other), "http://b:8080", str(folder), "fp")
        assert removed == [] and file(restored) in b.index and file(saved) in b.index, "both in use on A"
        assert (folder / file(restored)).exists() and (folder / file(saved)).exists()
        a.pool.release(slot_a, True)
        assert await _wait_for(lambda: slot_b.elsewhere is None and slot_b.restoring is None)
        assert b.files_in_use() == set()
        await b.index.enforce()
        assert len(b.index) == 1, "counted again once the slot is given back"
    finally:
        await a.stop()
        await b.stop()


def test_with_redis_no_cache_waits_unsaved_in_a_slot_another_replica_may_replace(
        start_backend: Any, start_proxy: Any, redis_server: RedisServer, tmp_path: Any, caplog: Any) -> None:
    """Another replica replaces a slot without saving what this one left there (it does not know its prompt), so
    with REDIS_URL a long prompt's cache is saved after its answer even past META_MAX (never left unsaved in its
    slot, `save_deferred`), and the limits never delete a file because a slot holds it (`in_slot`): that slot may
    be another replica's next. Each comes back through the other replica restored while its file is kept."""
    import logging

    backend = start_backend(slots=1)
    a, b = replicas(start_proxy, [backend], redis_server, tmp_path, meta_max=2, big_threshold_words=100)
    caplog.set_level(logging.INFO)
    bodies = [chats.request(700 + i, 260) for i in range(5)]
    for i, body in enumerate(bodies):
        proxy = (a, b)[i % 2]
        assert proxy.post(body).status_code == 200
        proxy.wait_finished(sum(1 for j in range(i + 1) if j % 2 == i % 2))
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "save_deferred" in m or "reason=in_slot" in m], said
    assert mock_stats(backend)["saves"] == len(bodies), "each saved once, after its answer"
    saved = {r.save_file: r for p in (a, b) for r in p.records}
    held = {s.content.key for s in a.pipeline.pool.slots if s.content is not None}
    kept = [k for k in a.pipeline.index._entries if k in saved and k not in held]
    assert kept, "a file the slot no longer holds is kept"
    body = bodies[[r.save_file for r in sorted(saved.values(), key=lambda r: r.started)].index(kept[0])]
    assert a.post(body).status_code == 200
    a.wait_finished(4)
    assert a.records[-1].restored and a.records[-1].cache_hit, a.records[-1]


async def test_a_slot_state_written_after_redis_lost_its_data_is_never_an_older_one(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """A Redis restarted empty is filled again by the replicas (`republish`): a slot's state by the replica its last
    grant went to, and never over a newer state another replica wrote since (last-writer-wins would bring the older
    belief back, and every replica would keep believing what the slot held before). Tokens keep growing across the
    loss (the counter has a clock floor), and the new state is what both replicas believe."""
    from lpcache.backends.slots import Content

    a, b = await _fleets(redis_server, tmp_path, 2)
    try:
        slot_a, slot_b = a.pool.slots[0], b.pool.slots[0]
        for i in range(5):   # tokens move on
            slot_a.busy = True
            assert await a.claim(slot_a)
            slot_a.content = Content(f"{i}" * 64, (i,), saved=True, model="m", tokens=10 + i)
            a.pool.release(slot_a, True)
            key = f"{i}" * 64
            assert await _wait_for(lambda key=key: slot_a.name not in a._releasing and slot_a.name not in a._handing
                                   and slot_b.content is not None and slot_b.content.key == key)
        seen = max(a._fences[slot_a.name], b._fences[slot_b.name])
        redis_server.kill()
        redis_server.restart()
        assert await _wait_for(lambda: a.healthy and b.healthy, 20)
        slot_b.busy = True
        assert await b.claim(slot_b)
        assert b._fences[slot_b.name] > seen, (b._fences, seen)
        slot_b.content = Content("e" * 64, (9,), saved=True, model="m", tokens=40)
        b.pool.release(slot_b, True)
        assert await _wait_for(lambda: slot_a.content is not None and slot_a.content.key == "e" * 64), \
            "the other replica takes the new state (a late republish of the older one must not win)"
    finally:
        await a.stop()
        await b.stop()


async def test_a_release_redis_never_took_holds_no_slot_long_once_redis_lost_its_data(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """A replica gives a slot back just as Redis dies: its release never reaches Redis, so the others still see the
    slot held there (`elsewhere`), and that replica is not back to say otherwise (here: gone). Redis comes back
    empty, the lease gone with its data: the slot is free for the others within a third of the lease's time and
    one call's bound (a live holder's renewal fails by then), not the whole lease's time they last saw, and what it
    holds is unknown. A claim made after the loss is seen again."""
    import time

    from lpcache.backends.slots import Content
    from lpcache.fleet.shared_map import CALL_TIMEOUT

    ttl = 12.0
    a, b, c = await _fleets(redis_server, tmp_path, 3, ttl_ms=int(ttl * 1000))
    stopped = False
    try:
        slot_a, slot_b, slot_c = (f.pool.slots[1] for f in (a, b, c))
        slot_b.content = Content("e" * 64, (4,), saved=True, model="m", tokens=20)   # B's belief before the claim
        slot_a.busy = True
        assert await a.claim(slot_a)
        assert await _wait_for(lambda: slot_b.elsewhere == "r0"), "B saw A's claim"
        redis_server.kill()
        slot_a.content = Content("f" * 64, (5,), saved=True, model="m", tokens=30)
        a.pool.release(slot_a, True)
        assert await _wait_for(lambda: slot_a.name not in a._releasing and slot_a.name not in a._handing)
        await a.stop()
        stopped = True
        assert slot_b.elsewhere == "r0" and slot_b.taken, "the release never reached B"
        redis_server.restart()
        assert await _wait_for(lambda: b.healthy and c.healthy and b.map.reloads > 0 and c.map.reloads > 0, 20), \
            "B and C noticed Redis lost its data"
        back = time.monotonic()
        assert await _wait_for(lambda: not slot_b.taken, ttl)
        assert time.monotonic() - back <= ttl / 3 + CALL_TIMEOUT + 0.5, "free well before the lease B saw lapsed"
        assert slot_b.content is None, "what A left there is unknown"
        slot_c.busy = True
        assert await c.claim(slot_c)
        assert await _wait_for(lambda: slot_b.elsewhere == "r2"), "a claim after the loss is seen again"
        slot_c.content = Content("g" * 64, (6,), saved=True, model="m", tokens=31)
        c.pool.release(slot_c, True)
        assert await _wait_for(lambda: slot_b.elsewhere is None and slot_b.content is not None
                               and slot_b.content.key == "g" * 64)
    finally:
        for fleet in (b, c) if stopped else (a, b, c):
            await fleet.stop()


async def test_a_request_in_its_slot_as_redis_loses_its_data_keeps_the_slot(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """A replica's request is in its slot when Redis restarts empty: once back, that replica takes its lease again,
    so another replica's claim of the slot is refused by Redis, and the others still see the slot held."""
    a, b = await _fleets(redis_server, tmp_path, 2, ttl_ms=12_000)
    try:
        slot_a, slot_b = a.pool.slots[0], b.pool.slots[0]
        slot_a.busy = True
        assert await a.claim(slot_a)
        assert await _wait_for(lambda: slot_b.elsewhere == "r0")
        redis_server.kill()
        redis_server.restart()
        assert await _wait_for(lambda: a.healthy and b.healthy and a.map.reloads > 0 and b.map.reloads > 0, 20)
        assert slot_b.taken, "still held by A's request"
        slot_b.busy = True
        assert not await b.claim(slot_b), "Redis refuses B's claim: A took its lease again"
        slot_b.busy = False
        assert a.valid(slot_a), "A's lease is still A's"
        a.pool.release(slot_a, True)
        assert await _wait_for(lambda: slot_b.elsewhere is None and not slot_b.taken)
    finally:
        await a.stop()
        await b.stop()


async def test_a_session_saved_on_another_server_is_looked_for_there_and_an_older_save_never_wins(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """Two servers with a slot-save folder each: a session saved on the first, then (its slots busy) on the second.
    The first server's copy is older, so both replicas look for the session on the second only (a restore of the
    older copy would compute again the turns saved since), and learn the tokens the newest file holds. A document
    of an older save (a replica writing again what it knew, after Redis lost its data) changes nothing."""
    import orjson

    from lpcache.backends.slots import Content
    from lpcache.flow.slot_fill import SlotFiller

    a, b = await _fleets(redis_server, tmp_path, 2, folder=str(tmp_path / "slots0"), servers=2)
    try:
        file = "m-route_séance-42.bin"
        info_a = a.sessions.known(file, "séance 42", "m-route", None)
        a.sessions.saved(info_a, 0, 1000, (1, 2), tokens=400)
        assert await _wait_for(lambda: b.sessions.get(file) is not None and b.sessions.get(file).latest == 0)
        info_b = b.sessions.get(file)
        assert info_b.saved_tokens == 400 and info_b.homes == {0}
        older = orjson.dumps({"session": "séance 42", "route": "m-route", "file": file, "owner": None,
                              "file_bytes": 1000, "chain": [1, 2], "tokens": 400, "at": info_a.saved_at,
                              "homes": ["http://b:8080"], "latest": "http://b:8080"})
        b.sessions.saved(info_b, 1, 1200, (1, 2, 3), tokens=480)
        assert await _wait_for(lambda: info_a.latest == 1), "A learns where the newest copy is"
        assert info_a.homes == {0, 1} and info_a.saved_tokens == 480 and info_a.saved_chain == (1, 2, 3)
        for fleet in (a, b):
            homes = SlotFiller.session_homes(fleet, Content(file, (1, 2, 3, 4)))   # type: ignore[arg-type]
            assert homes == {1}, homes
        a.on_change("sessions", file, older)
        assert info_a.latest == 1 and info_a.saved_chain == (1, 2, 3) and info_a.saved_tokens == 480, \
            "an older save's document is not taken over a newer one"
    finally:
        await a.stop()
        await b.stop()


async def test_a_release_of_a_lease_no_longer_held_is_logged_as_failed_and_writes_nothing(
        redis_server: RedisServer, tmp_path: Any, caplog: Any) -> None:
    """A replica's lease is gone when it gives the slot back (it lapsed while the replica was cut off, or Redis lost
    it): the release script refuses to write. That is a failed release, logged, and what the replica left in the
    slot is not published as if it were."""
    import logging

    import redis as redis_sync

    from lpcache.backends.slots import Content
    from lpcache.fleet.leases import PREFIX

    a, b = await _fleets(redis_server, tmp_path, 2)
    try:
        slot_a, slot_b = a.pool.slots[0], b.pool.slots[0]
        slot_a.busy = True
        assert await a.claim(slot_a)
        assert await _wait_for(lambda: slot_b.elsewhere == "r0")
        redis_sync.Redis.from_url(redis_server.url).delete(PREFIX + slot_a.name)   # the lease is gone
        slot_a.content = Content("d" * 64, (3,), saved=True, model="m", tokens=12)
        with caplog.at_level(logging.WARNING, logger="lpcache.fleet"):
            a.pool.release(slot_a, True)
            assert await _wait_for(lambda: slot_a.name not in a._releasing and slot_a not in a._handing)
        failed = [r.getMessage() for r in caplog.records if "slot_release_failed" in r.getMessage()]
        assert failed and "lease_no_longer_held" in failed[0], caplog.text
        assert _state(redis_server, slot_a.name).get("content") is None, "nothing written under a lost lease"
        assert slot_b.content is None or slot_b.content.key != "d" * 64
    finally:
        await a.stop()
        await b.stop()


async def test_a_file_another_replicas_entry_names_is_no_orphan_and_one_nobody_names_goes(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """Two replicas, one slot-save folder: a file only replica A's meta file names (B knows it through Redis) stays
    when B sweeps; a file no replica names (A killed mid-save, its marker on another host) goes after the grace
    period; one A's request is saving now stays."""
    import time
    from dataclasses import replace

    from lpcache.backends.placement import Want
    from lpcache.cache.meta_files import prefix_file
    from lpcache.cache.prefix import Prompt

    folder = tmp_path / "slots"
    folder.mkdir()

    def prompt(tag: str) -> Prompt:
        p = Prompt.of("m", [{"role": "user", "content": " ".join(f"{tag}{i}, «Ünïcode»" for i in range(60))}], 10)
        return replace(p, exact=p.chain)

    a, b = await _fleets(redis_server, tmp_path, 2, folder=str(folder))
    try:
        named, lost, busy = prompt("named"), prompt("lost"), prompt("busy")
        files = {p.key: folder / prefix_file(p.key, "fp") for p in (named, lost, busy)}
        for path in files.values():
            path.write_bytes(b"kv")
            os.utime(path, (time.time() - 3600, time.time() - 3600))
        await a.index.add(named, prefix_file(named.key, "fp"), "http://b:8080", str(folder), "fp")
        assert await _wait_for(lambda: prefix_file(named.key, "fp") in b.index)
        slot_a, slot_b = a.pool.slots[0], b.pool.slots[0]
        slot_a.busy = True
        assert await a.claim(slot_a, Want(busy, file_of=lambda slot: prefix_file(busy.key, "fp")))
        assert await _wait_for(lambda: slot_b.elsewhere == "r0")
        assert await b.index.sweep_orphans(600.0) == 1
        assert files[named.key].exists() and files[busy.key].exists() and not files[lost.key].exists()
        a.pool.release(slot_a, True)
    finally:
        await a.stop()
        await b.stop()


async def test_the_sweep_judges_only_files_every_replica_had_published_its_entries_for(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """Replica B cut off from Redis (its link only) goes on saving; A's sweep keeps what B may name only locally
    (written after B was last in sync), an entry A cannot read (a newer lpcache's), and sweeps nothing while A is
    cut off itself or Redis lost its data less than a grace period ago; a file written before every replica's last
    sync that nobody names goes."""
    import time

    import redis as redis_sync

    from lpcache.fleet.synced import SINCE

    folder = tmp_path / "slots"
    folder.mkdir()
    grace, now = 600.0, time.time()
    a, b = await _fleets(redis_server, tmp_path, 2, folder=str(folder))
    try:
        a.index._folders.add(str(folder))   # as MetaIndex(slot_save_paths=BACKENDS folders) in the app
        assert await a.sweep_horizon(grace) is None, "the registry is new: the replicas may still be writing again"
        files = {name: folder / (name * 64) for name in "abc"}
        for name, age in (("a", 1000), ("b", 2100), ("c", 2100)):
            files[name].write_bytes(b"kv")
            os.utime(files[name], (now - age, now - age))
        with redis_sync.Redis.from_url(redis_server.url) as r:
            r.hset("lpcache:synced", mapping={SINCE: now - 5000, "r1": now - 2000})   # B: in sync 2,000 s ago
        b.map._went_down(OSError("partition: B cannot reach Redis"))
        await a.map.put("index", "c" * 64, b'{"format": "a newer lpcache\'s"}')
        before = await a.sweep_horizon(grace)
        assert before is not None and before < now - 2000
        assert await a.index.sweep_orphans(grace, before) == 1
        assert [n for n, f in files.items() if f.exists()] == ["a", "c"], \
            "a: B may name it; c: an entry A cannot read names it; b: nobody, before B's last sync"
        # A cut off itself: no sweep
        a.map._went_down(OSError("partition: A cannot reach Redis"))
        assert await a.sweep_horizon(grace) is None
    finally:
        await a.stop()
        await b.stop()


async def test_a_write_that_failed_while_redis_stayed_up_is_written_before_the_next_sweep(
        redis_server: RedisServer, tmp_path: Any) -> None:
    """One shared write failing (a timeout while Redis stalled) with the link staying up brings no reconnect and no
    republish: the replica writes it again itself at its next sweep, and is in sync again (else it would never
    sweep, and after GONE_AFTER the others would take it for gone)."""
    import time

    import redis as redis_sync
    from redis.exceptions import TimeoutError as RedisTimeout

    from lpcache.fleet.synced import SINCE

    grace, now = 600.0, time.time()
    folder = tmp_path / "slots"
    folder.mkdir()
    a, b = await _fleets(redis_server, tmp_path, 2, folder=str(folder))
    try:
        with redis_sync.Redis.from_url(redis_server.url) as r:
            r.hset("lpcache:synced", mapping={SINCE: now - 5000})
        assert await b.sweep_horizon(grace) is not None
        written = b.map._script

        async def stalled(*args: Any, **kwargs: Any) -> Any:
            raise RedisTimeout("Timeout reading from socket")

        b.map._script = stalled
        await b._write("index", "d" * 64, b'{"format": "a newer lpcache\'s"}')
        b.map._script = written
        assert b.map.healthy and b._unpublished, "one failed call: the link is still up, nothing to reconnect"
        assert await b.sweep_horizon(grace) is not None
        assert not b._unpublished
    finally:
        await a.stop()
        await b.stop()
