"""The shared map against a real Redis: replicas converge, catch up, reload after gaps, and survive Redis going away."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from lpcache.cache.meta_files import MetaEntry, meta_document
from lpcache.fleet.shared_map import SharedMap, SharedStoreDown, connect
from lpcache.workloads.harness import RedisServer

NS = ("index", "slots")


class Replica:
    """A SharedMap with what its on_change and on_reconnect calls reported, and what it owns (writes again after a
    reconnection, as lpcache's index will)."""

    def __init__(self, url: str, name: str, **options: Any) -> None:
        self.client = connect(url)
        self.changes: list[tuple[str, str, bytes | None]] = []
        self.reconnects: list[bool] = []
        self.owned: dict[str, bytes] = {}
        self.changed = asyncio.Event()
        options = {"block": 0.2, "backoff": (0.05, 0.3), **options}
        self.map = SharedMap(self.client, NS, name, self._on_change, on_reconnect=self._on_reconnect, **options)

    def _on_change(self, ns: str, key: str, value: bytes | None) -> None:
        self.changes.append((ns, key, value))
        self.changed.set()

    async def _on_reconnect(self, lost: bool) -> None:
        self.reconnects.append(lost)
        if self.owned:
            await self.map.update("index", puts=self.owned)

    async def own(self, key: str, value: bytes) -> None:
        self.owned[key] = value
        await self.map.put("index", key, value)


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., Replica]]:
    made: list[Replica] = []

    def make(name: str, **options: Any) -> Replica:
        made.append(Replica(redis_server.url, name, **options))
        return made[-1]

    yield make
    for r in made:
        await r.map.stop()
        await r.client.aclose()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `check()` holds, polling the loop, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)   # poll interval of a condition with a deadline, not synchronisation


def contents(r: Replica, ns: str = "index") -> dict[str, bytes]:
    return dict(r.map.items(ns))


async def test_two_replicas_converge_on_puts_and_deletes(replicas: Callable[..., Replica],
                                                         redis_server: RedisServer) -> None:
    a, b = replicas("a"), replicas("b")
    await a.map.start()
    await b.map.start()
    assert a.map.healthy and b.map.healthy
    await a.map.update("index", puts={"k1": b"one", "k2": b"two"})
    await a.map.put("slots", "s0", b"slot")
    assert a.map.get("index", "k1") == b"one"            # read-your-writes, before the stream comes back
    await until(lambda: len(b.changes) == 3)
    assert sorted(b.changes) == [("index", "k1", b"one"), ("index", "k2", b"two"), ("slots", "s0", b"slot")]
    await a.map.delete("index", "k1")
    await until(lambda: b.map.get("index", "k1") is None)
    assert b.changes[-1] == ("index", "k1", None)
    assert contents(b) == {"k2": b"two"} and b.map.items("slots") == [("s0", b"slot")]
    await a.map.delete("index", "never-there")            # a no-op: no change written
    await b.map.put("index", "k3", b"three")
    await until(lambda: a.map.get("index", "k3") == b"three")
    assert a.changes == [("index", "k3", b"three")]       # a's own writes are not reported back to it
    assert len(b.changes) == 4
    assert a.map.reloads == b.map.reloads == 0

    raw = aioredis.Redis.from_url(redis_server.url)       # the documented data model
    stored = await raw.hgetall("lpcache:map:index")
    assert stored == {b"k2": b"2:two", b"k3": b"5:three"}
    entries = await raw.xrange("lpcache:changes")
    assert [e[1] for e in entries][-3:] == [
        {b"ns": b"slots", b"key": b"s0", b"op": b"put", b"replica": b"a", b"version": b"3"},
        {b"ns": b"index", b"key": b"k1", b"op": b"del", b"replica": b"a", b"version": b"4"},
        {b"ns": b"index", b"key": b"k3", b"op": b"put", b"replica": b"b", b"version": b"5"},
    ]
    assert [int(e[1][b"version"]) for e in entries] == [1, 2, 3, 4, 5]   # ... one entry per change, consecutive
    await raw.aclose()


async def test_concurrent_writes_to_one_key_end_with_the_last_version_on_both(
        replicas: Callable[..., Replica], redis_server: RedisServer) -> None:
    a, b = replicas("a"), replicas("b")
    await a.map.start()
    await b.map.start()
    await asyncio.gather(*(r.map.put("index", "hot", f"{r.map.replica_id}{i}".encode())
                           for i in range(40) for r in (a, b)))
    raw = aioredis.Redis.from_url(redis_server.url)
    final = await raw.hget("lpcache:map:index", "hot")
    assert final is not None and final.startswith(b"80:")   # the 80th change is the last one
    await until(lambda: a.map.get("index", "hot") == b.map.get("index", "hot") == final[3:])
    await raw.aclose()


async def test_a_late_mirror_loads_and_a_stopped_one_catches_up_from_the_stream(
        replicas: Callable[..., Replica]) -> None:
    a = replicas("a")
    await a.map.start()
    await a.map.update("index", puts={f"k{i}": b"v%d" % i for i in range(5)})
    c = replicas("c")
    await c.map.start()                                   # loads what is there, reporting each key
    assert contents(c) == contents(a) and len(c.changes) == 5
    await c.map.stop()
    assert not c.map.healthy
    await a.map.put("index", "k5", b"v5")
    await a.map.delete("index", "k0")
    c.changes.clear()
    await c.map.start()                                   # goes on from its stream position
    await until(lambda: len(c.changes) == 2)
    assert sorted(c.changes) == [("index", "k0", None), ("index", "k5", b"v5")]
    assert contents(c) == contents(a) and c.map.reloads == 0


async def test_a_trimmed_stream_makes_a_returning_mirror_reload(replicas: Callable[..., Replica],
                                                               redis_server: RedisServer) -> None:
    a, c = replicas("a"), replicas("c")
    await a.map.start()
    await a.map.update("index", puts={"old1": b"1", "old2": b"2"})
    await c.map.start()
    await c.map.stop()
    await a.map.delete("index", "old1")
    raw = aioredis.Redis.from_url(redis_server.url)
    assert await raw.xtrim("lpcache:changes", maxlen=0) == 3   # the deletion c never read is gone
    await a.map.put("index", "new", b"3")
    c.changes.clear()
    await c.map.start()
    await until(lambda: c.map.reloads == 1 and c.map.get("index", "new") == b"3")
    assert sorted(c.changes, key=str) == sorted([("index", "old1", None), ("index", "new", b"3")], key=str)
    assert contents(c) == {"old2": b"2", "new": b"3"}

    await c.map.stop()                                    # the same with nothing written after the trim
    await a.map.delete("index", "old2")
    assert await raw.xtrim("lpcache:changes", maxlen=0) == 2   # "new" and the deletion
    await c.map.start()
    await until(lambda: c.map.reloads == 2)
    assert contents(c) == {"new": b"3"} and c.changes[-1] == ("index", "old2", None)
    await raw.aclose()


async def test_a_redis_restart_keeps_the_map_and_the_writes_that_failed_are_made_again(
        replicas: Callable[..., Replica], redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "lpcache.shared_map")
    a, b = replicas("a"), replicas("b")
    await a.map.start()
    await b.map.start()
    await a.own("ka", b"A")
    await until(lambda: b.map.get("index", "ka") == b"A")
    await asyncio.to_thread(redis_server.stop)            # SIGTERM: Redis saves, then exits
    await until(lambda: not a.map.healthy and not b.map.healthy)
    assert a.map.get("index", "ka") == b.map.get("index", "ka") == b"A"   # still served locally
    b.owned["kb"] = b"B"                                  # b's index changed while Redis was away
    started = time.monotonic()
    with pytest.raises(SharedStoreDown):
        await b.map.put("index", "kb", b"B")
    assert time.monotonic() - started < 1.0
    await asyncio.to_thread(redis_server.restart)
    await until(lambda: a.map.healthy and b.map.healthy)
    assert a.reconnects == b.reconnects == [False]        # data kept: b writes again what failed
    await until(lambda: a.map.get("index", "kb") == b"B")
    assert contents(a) == contents(b) == {"ka": b"A", "kb": b"B"}
    await a.map.put("index", "after", b"x")
    await until(lambda: b.map.get("index", "after") == b"x")
    messages = [r.getMessage().split()[0] for r in caplog.records]
    assert messages.count("shared_map_down") == messages.count("shared_map_back") == 2   # one each per replica


async def test_a_redis_that_lost_its_data_is_filled_again_by_the_owners(
        replicas: Callable[..., Replica], redis_server: RedisServer) -> None:
    a, b, c = replicas("a"), replicas("b"), replicas("c")
    for r in (a, b, c):
        await r.map.start()
    await a.own("ka", b"A")
    await b.own("kb", b"B")
    await c.own("kc", b"C")
    await until(lambda: all(len(contents(r)) == 3 for r in (a, b)))
    await c.map.stop()                                    # c is gone: nobody writes kc again
    await asyncio.to_thread(redis_server.kill)            # SIGKILL: nothing was saved
    await until(lambda: not a.map.healthy and not b.map.healthy)
    assert contents(a) == contents(b) == {"ka": b"A", "kb": b"B", "kc": b"C"}
    await asyncio.to_thread(redis_server.restart)         # empty
    await until(lambda: a.map.healthy and b.map.healthy)
    assert a.reconnects == b.reconnects == [True]
    await until(lambda: contents(a) == contents(b) == {"ka": b"A", "kb": b"B"})
    assert ("index", "kc", None) in a.changes and ("index", "kc", None) in b.changes


async def test_a_flushed_redis_is_noticed_while_idle(replicas: Callable[..., Replica],
                                                     redis_server: RedisServer) -> None:
    a, b = replicas("a"), replicas("b")
    await a.map.start()
    await b.map.start()
    await a.own("ka", b"A")
    await b.own("kb", b"B")
    await until(lambda: len(contents(a)) == len(contents(b)) == 2)
    raw = aioredis.Redis.from_url(redis_server.url)
    await raw.flushall()                                  # no restart, no error: only the epoch tells
    await until(lambda: a.reconnects == [True] and b.reconnects == [True])
    await until(lambda: contents(a) == contents(b) == {"ka": b"A", "kb": b"B"})
    assert await raw.hlen("lpcache:map:index") == 2
    await raw.aclose()


async def test_a_redis_down_at_start_is_reached_when_it_comes_up(replicas: Callable[..., Replica],
                                                                 redis_server: RedisServer) -> None:
    a = replicas("a")
    await a.map.start()
    await asyncio.to_thread(redis_server.kill)
    b = replicas("b")
    b.owned["kb"] = b"B"
    started = time.monotonic()
    await b.map.start()
    assert time.monotonic() - started < 2.0 and not b.map.healthy
    with pytest.raises(SharedStoreDown):
        await b.map.put("index", "x", b"x")
    await asyncio.to_thread(redis_server.restart)
    await until(lambda: b.map.healthy and a.map.healthy)
    assert b.reconnects == [True]                         # never reached: it writes all it owns
    await until(lambda: a.map.get("index", "kb") == b"B")
    await b.map.put("index", "x", b"x")
    await until(lambda: a.map.get("index", "x") == b"x")


def realistic_entry(n_blocks: int = 250) -> bytes:
    """The meta document of a 4,000-token prompt's save: ~250 identity digests (16 tokens each), 30 word blocks."""
    entry = MetaEntry(key="ab" * 32, model="qwen2.5-coder-7b", wpb=100, chain=(), timestamp=time.time(),
                      n_words=3000, backend="http://10.0.0.7:8080", slot_save_path="/var/lib/llama/slots",
                      exact=tuple((i * 0x9E3779B97F4A7C15) % 2**64 for i in range(n_blocks)),
                      fingerprint="f" * 16, n_tokens=4000, size=96_000_000, uses=3, interval=120.0)
    return orjson.dumps(meta_document(entry, ["cd" * 32] * 30))


async def test_memory_per_entry_and_round_trips(replicas: Callable[..., Replica], redis_server: RedisServer) -> None:
    a = replicas("a")
    await a.map.start()
    value, n = realistic_entry(), 500
    for i in range(n):
        await a.map.put("index", f"{i:064x}", value)
    raw = aioredis.Redis.from_url(redis_server.url)
    hash_bytes = await raw.memory_usage("lpcache:map:index", samples=0)
    stream_bytes = await raw.memory_usage("lpcache:changes", samples=0)
    assert hash_bytes is not None and stream_bytes is not None
    per_entry, per_change = hash_bytes / n, stream_bytes / n
    loops = 2000
    started = time.perf_counter()
    for i in range(loops):
        a.map.get("index", f"{i % n:064x}")
    get_us = (time.perf_counter() - started) / loops * 1e6
    started = time.perf_counter()
    for i in range(200):
        await a.map.put("index", f"{i:064x}", value)
    put_ms = (time.perf_counter() - started) / 200 * 1e3
    started = time.perf_counter()
    for _ in range(200):
        await a.client.ping()
    ping_ms = (time.perf_counter() - started) / 200 * 1e3
    print(f"\nvalue={len(value)} B  hash/entry={per_entry:.0f} B  stream/change={per_change:.0f} B  "
          f"get={get_us:.2f} us  put={put_ms:.3f} ms  (PING {ping_ms:.3f} ms)")
    assert len(value) < per_entry < len(value) * 1.5      # the JSON plus Redis's overhead, no copy elsewhere
    assert per_change < 200                               # the stream names changes, it does not hold values
    assert get_us < 50 and put_ms < 20                    # loose: a busy 2-core machine
    await raw.aclose()


async def test_a_malformed_stream_entry_costs_a_reload_not_the_follower(
        replicas: Callable[..., Replica], redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    a, b = replicas("a"), replicas("b")
    await a.map.start()
    await b.map.start()
    raw = aioredis.Redis.from_url(redis_server.url)
    await raw.xadd("lpcache:changes", {"something": "else"})   # not written by a SharedMap
    await until(lambda: b.map.reloads == 1)
    assert "shared_map_failed" in caplog.text
    await a.map.put("index", "k", b"v")
    await until(lambda: b.map.get("index", "k") == b"v")
    assert b.map.healthy and b.map.reloads == 1
    await raw.aclose()
