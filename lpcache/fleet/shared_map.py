"""A map the lpcache replicas share through Redis, with a local mirror for lookups (issue 13, docs/scale-out-map.md).

Redis holds the truth: one hash per namespace, `<prefix>:map:<ns>` (field: the key; value: `<version>:<payload>`),
and one change stream for all namespaces, `<prefix>:changes`, whose entries say what changed ({ns, key, op, replica,
version}), never the value. A write is one Lua script: INCR `<prefix>:version`, HSET or HDEL, XADD with approximate
trimming. So the hash and the stream never disagree, and the versions in the stream are consecutive: a change that
was trimmed away before a replica read it shows as a gap, and the replica reloads everything.

Each replica keeps a dict per namespace, loaded at start and then kept current by one task that follows the stream.
For the keys a batch of entries names, the task reads the hash: the mirror takes Redis's current value, and a newer
version is never replaced by an older one. Lookups (`get`, `items`) read only the dict: no round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from lpcache.errors import SharedStoreDown

log = logging.getLogger("lpcache.shared_map")

# Seconds a Redis call may take at most, whatever the client does: above the client's own bound (`connect`:
# 0.5 s socket timeouts, one retry), which fails a call cleanly; this one cuts it mid-reply, so the connections go.
CALL_TIMEOUT = 2.5

OnChange = Callable[[str, str, bytes | None], None]
OnReconnect = Callable[[bool], Awaitable[None]]
BATCH = 512          # stream entries read (and keys fetched) per round trip
READ_MARGIN = 2.0    # seconds a blocked XREAD may take beyond its BLOCK before the connection counts as dead

_WRITE = """
local out = {}
local function change(key, op)
  local v = redis.call('INCR', KEYS[1])
  local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*',
                        'ns', ARGV[1], 'key', key, 'op', op, 'replica', ARGV[2], 'version', v)
  out[#out + 1] = v
  out[#out + 1] = id
  return v
end
local n = tonumber(ARGV[4])
for i = 5, 4 + 2 * n, 2 do
  local v = change(ARGV[i], 'put')
  redis.call('HSET', KEYS[3], ARGV[i], v .. ':' .. ARGV[i + 1])
end
for i = 5 + 2 * n, #ARGV do
  if redis.call('HDEL', KEYS[3], ARGV[i]) == 1 then
    change(ARGV[i], 'del')
  else
    out[#out + 1] = 0
    out[#out + 1] = ''
  end
end
return out
"""


def connect(url: str, timeout: float = 0.5) -> aioredis.Redis:
    """A client fit for `SharedMap`: bytes replies, short socket timeouts and one immediate retry (on a new connection
    when a pooled one died with a Redis restart), so a write to a Redis that is gone fails within about twice
    `timeout` seconds (redis-py retries ten times by default, with backoff)."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                   retry=Retry(NoBackoff(), 1))


class SharedMap:
    """str key -> bytes value, per namespace, shared by every replica through Redis and mirrored locally.

    All methods run on one event loop (not thread-safe). `on_change(ns, key, value)` (value None: deleted) is called on
    that loop for every change the mirror takes from Redis: other replicas' writes, a reload's differences (every key
    at the first load), and, rarely, this replica's own write whose answer was lost. It must be quick and must not
    await. `on_reconnect(lost)` is awaited when Redis is reachable again after a failure, before the mirror reloads:
    the owner writes again what failed meanwhile; with `lost` True (Redis lost its data, or was never reached since
    start) everything it owns.
    """

    def __init__(self, client: aioredis.Redis, namespaces: Iterable[str], replica_id: str,
                 on_change: OnChange | None = None, *, on_reconnect: OnReconnect | None = None,
                 prefix: str = "lpcache", maxlen: int = 10_000, block: float = 1.0,
                 backoff: tuple[float, float] = (0.1, 5.0), own_applied: Iterable[str] = (),
                 gather: float = 0.0) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("SharedMap needs a client that returns bytes (decode_responses=False)")
        self.client = client
        self.replica_id = replica_id
        self.on_change = on_change
        self.on_reconnect = on_reconnect
        self.maxlen = maxlen
        self.block = block
        self.backoff = backoff
        self._data: dict[str, dict[str, tuple[int, bytes]]] = {ns: {} for ns in namespaces}
        self._hash = {ns: f"{prefix}:map:{ns}" for ns in self._data}
        self._stream, self._counter, self._epoch_key = f"{prefix}:changes", f"{prefix}:version", f"{prefix}:epoch"
        self._script = client.register_script(_WRITE)
        self._lock = asyncio.Lock()   # one at a time: a write, applying a batch, a reload (no interleaved reads)
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()      # cuts the backoff after a failure short (`stop`, `back_within`)
        self._up = asyncio.Event()        # set while Redis answers (not `down`)
        self._down_at = 0.0               # when it went down (monotonic)
        self._task: asyncio.Task[None] | None = None
        self._epoch: bytes | None = None   # a random token Redis keeps: another one means another data set
        self._position = "0-0"             # the last stream entry applied ...
        self._version = 0                  # ... and its version
        self._written: str | None = None   # the stream id of this replica's last write since the last load
        self._seen = 0                     # the highest version known to exist (a lower counter: data lost)
        self._load_needed = True
        self._down = False                 # failed since the last load: writes fail at once
        self._unpublished = False          # Redis may not hold what this replica owns (lost, or never reached)
        self.healthy = False
        self.reloads = 0                   # full loads after the first (gaps, reconnections, losses)
        # Namespaces whose changes by this replica's own scripts (`keys_of`) the follower does not read back: the
        # caller applied them itself (fleet's slot states), which spares a round trip per change.
        self.own_applied = frozenset(own_applied)
        self.gather = gather   # seconds to let changes gather after a batch: fewer wake-ups under load
        self._own = replica_id.encode()

    @property
    def down(self) -> bool:
        """Redis failed since the last load and has not answered since: writes fail at once (`healthy` is also
        False while a reload runs, with Redis answering)."""
        return self._down

    def down_for(self) -> float:
        """Seconds since Redis went down (0 while it answers)."""
        return time.monotonic() - self._down_at if self._down else 0.0

    async def back_within(self, seconds: float) -> bool:
        """Whether Redis answers again within `seconds`: the follower tries it at once (not at the end of its
        backoff). A Redis restarted by its supervisor is back in a fraction of a second; a replica that decided
        alone meanwhile could hand a slot another replica uses."""
        if not self._down:
            return True
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._up.wait(), seconds)
        return not self._down

    def keys_of(self, ns: str) -> tuple[str, str, str]:
        """(version counter, change stream, the namespace's hash): for a script of another module that writes a
        change the map's way (INCR, HSET `<version>:<payload>`, XADD {ns, key, op, replica, version}) together
        with a write of its own, atomically (`fleet`'s slot release)."""
        return self._counter, self._stream, self._hash[ns]

    # ---- reads: the local mirror only ----

    def get(self, ns: str, key: str) -> bytes | None:
        found = self._data[ns].get(key)
        return None if found is None else found[1]

    def items(self, ns: str) -> list[tuple[str, bytes]]:
        """A snapshot (safe to keep across awaits)."""
        return [(key, value) for key, (_, value) in self._data[ns].items()]

    def count(self, ns: str) -> int:
        return len(self._data[ns])

    # ---- writes: Redis first, then the mirror ----

    async def put(self, ns: str, key: str, value: bytes) -> None:
        await self.update(ns, puts={key: value})

    async def delete(self, ns: str, key: str) -> None:
        await self.update(ns, deletes=(key,))

    async def update(self, ns: str, puts: Mapping[str, bytes] | None = None, deletes: Iterable[str] = ()) -> None:
        """Put and delete keys of one namespace in one round trip, atomically. SharedStoreDown when Redis is
        unreachable: nothing was written (or, after a timeout, maybe all of it: the stream will tell)."""
        table = self._data[ns]   # KeyError: not a namespace of this map
        puts = puts or {}
        dels = [key for key in deletes if key not in puts]
        if self._down:
            raise SharedStoreDown(f"Redis is unreachable: not written to {ns}")
        args: list[Any] = [ns, self.replica_id, self.maxlen, len(puts)]
        for item in puts.items():
            args += item
        async with self._lock:
            try:
                out = await self._script(keys=[self._counter, self._stream, self._hash[ns]], args=[*args, *dels])
            except (RedisError, OSError) as e:
                raise SharedStoreDown(f"Redis did not take a write to {ns}: {e}") from e
            changes: list[tuple[str, bytes | None]] = [*puts.items(), *((key, None) for key in dels)]
            for (key, value), version, sid in zip(changes, out[::2], out[1::2], strict=True):
                if value is None:
                    table.pop(key, None)
                else:
                    table[key] = (int(version), value)
                if sid:
                    self._written = _text(sid)
                    self._seen = max(self._seen, int(version))

    # ---- the follower ----

    async def start(self) -> None:
        """Load the map (or, after `stop`, go on from where it stopped), then follow the stream in a task. Returns
        within the client's timeout when Redis is unreachable: the mirror then serves what it has and keeps trying."""
        if self._task is not None:
            return
        self._stop.clear()
        if self._load_needed:
            try:
                await self._reload()
            except (RedisError, OSError, SharedStoreDown) as e:
                self._went_down(e)
        self._task = asyncio.create_task(self._run(), name="lpcache-shared-map")

    async def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.healthy = False

    async def _run(self) -> None:
        delay = self.backoff[0]
        while not self._stop.is_set():
            try:
                if self._load_needed:
                    await self._reload()
                await self._follow()
                self.healthy, delay = True, self.backoff[0]
            except (RedisError, OSError, SharedStoreDown) as e:
                self._went_down(e)
            except Exception:   # a malformed entry, a bug: never let the task die; reload after the backoff
                log.exception("shared_map_failed")
                self.healthy, self._load_needed = False, True
                with contextlib.suppress(RedisError, OSError):   # a connection a reply behind is not used again
                    await self.client.connection_pool.disconnect()
            else:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)   # backoff, cut short by stop() or back_within()
            self._wake.clear()
            delay = min(delay * 2, self.backoff[1])

    def _went_down(self, e: BaseException) -> None:
        if not self._down:
            log.warning("shared_map_down reason=%r: serving the local mirror (%d keys), writes fail until Redis is "
                        "back", e, sum(map(len, self._data.values())))
            self._down_at = time.monotonic()
        self._down, self.healthy, self._load_needed = True, False, True
        self._up.clear()
        self._unpublished |= self._epoch is None   # never loaded: nothing this replica owns is in Redis

    async def _follow(self) -> None:
        entries = await self._xread()
        if not entries:   # quiet: check nothing was lost or missed meanwhile
            self._load_needed = any(await self._probe())
            return
        await self._apply_batch(entries)
        if self.gather > 0:
            await asyncio.sleep(self.gather)

    async def _apply_batch(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        async with self._lock:
            last: dict[tuple[str, str], tuple[int, bytes]] = {}   # the last change of each key in the batch
            version = self._version
            for _, fields in entries:
                v = int(fields[b"version"])
                if v != version + 1:
                    log.info("shared_map_gap expected=%d found=%d: changes left the stream before this replica read "
                             "them; reloading", version + 1, v)
                    self._load_needed = True
                    return
                version = v
                ns = _text(fields[b"ns"])
                if ns in self.own_applied and fields.get(b"replica") == self._own:
                    continue
                if ns in self._data:
                    last[(ns, _text(fields[b"key"]))] = (v, fields[b"op"])
            fetch = []
            for (ns, key), (v, op) in last.items():
                cur = self._data[ns].get(key)
                if op == b"del":
                    self._apply(ns, key, None, v)   # a put after it is further on in the stream
                elif cur is None or cur[0] < v:     # not held yet (an own write is): read the value
                    fetch.append((ns, key, v))
            if fetch:
                pipe = self.client.pipeline(transaction=False)
                for ns, key, _ in fetch:
                    pipe.hget(self._hash[ns], key)
                for (ns, key, v), raw in zip(fetch, await pipe.execute(), strict=True):
                    self._apply(ns, key, None if raw is None else _decode(raw), v)
            self._position, self._version, self._seen = entries[-1][0], version, max(self._seen, version)

    def _apply(self, ns: str, key: str, now: tuple[int, bytes] | None, notified: int) -> None:
        table = self._data[ns]
        cur = table.get(key)
        if now is None:
            if cur is not None and cur[0] <= notified:   # not a put newer than the deletion (an own one)
                del table[key]
                self._notify(ns, key, None)
        elif cur is None or now[0] > cur[0]:
            table[key] = now
            if cur is None or cur[1] != now[1]:
                self._notify(ns, key, now[1])

    async def _xread(self) -> list[tuple[str, dict[bytes, bytes]]]:
        """XREAD BLOCK on a connection of its own with a read timeout longer than the block (the client's socket
        timeout is short, for writes)."""
        pool = self.client.connection_pool
        conn = await pool.get_connection()
        done = False
        try:
            await conn.send_command("XREAD", "COUNT", BATCH, "BLOCK", int(self.block * 1000),
                                    "STREAMS", self._stream, self._position)
            reply = await conn.read_response(timeout=self.block + READ_MARGIN)
            done = True
        finally:
            if not done:
                await conn.disconnect()
            await pool.release(conn)
        if not reply:
            return []
        streams = reply.values() if isinstance(reply, dict) else (s[1] for s in reply)   # RESP3 or RESP2
        return [(_text(sid), fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=True)))
                for entries in streams for sid, fields in entries]

    # ---- checks and full loads ----

    async def _probe(self) -> tuple[bool, bool]:
        """(lost, missed): whether Redis lost data this replica knew of (another epoch, a lower version counter, or an
        entry it read or wrote gone while the stream's head is older: not trimmed), and whether changes it has not
        read left the stream (the counter is ahead, nothing follows its position). Fails when Redis is not there."""
        ids = [i for i in (self._position, self._written) if i and i != "0-0"]
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self._epoch_key)
        pipe.get(self._counter)
        pipe.xrange(self._stream, count=1)
        pipe.xrange(self._stream, f"({self._position}", "+", count=1)
        for i in ids:
            pipe.xrange(self._stream, i, i)
        epoch, counter, head, after, *found = await pipe.execute()
        counter = int(counter or 0)
        if self._epoch is None:
            return False, False
        gone = bool(head) and any(not f and _sid(head[0][0]) <= _sid(i) for i, f in zip(ids, found, strict=True))
        return epoch != self._epoch or counter < self._seen or gone, counter > self._version and not after

    async def _reload(self) -> None:
        if self._down:
            await self.client.connection_pool.disconnect(inuse_connections=False)   # idle ones died with Redis
        lost_data, _ = await self._probe()
        if lost_data:
            log.warning("shared_map_lost: Redis lost data this replica knew of; each replica writes again what it owns")
        lost = lost_data or self._unpublished
        back, self._down, self._unpublished = self._down, False, lost
        self._up.set()
        if self.on_reconnect is not None and (back or lost):
            try:
                await self.on_reconnect(lost)
            except SharedStoreDown:
                raise
            except Exception:
                log.exception("shared_map_on_reconnect_failed")
        async with self._lock:
            await self.client.set(self._epoch_key, secrets.token_hex(8), nx=True)
            pipe = self.client.pipeline(transaction=True)
            pipe.get(self._epoch_key)
            pipe.get(self._counter)
            pipe.xrevrange(self._stream, count=1)
            epoch, counter, last = await pipe.execute()
            loaded = {ns: {_text(k): _decode(v) async for k, v in self.client.hscan_iter(name, count=1000)}
                      for ns, name in self._hash.items()}
            first = self._epoch is None
            for ns, table in loaded.items():
                old, self._data[ns] = self._data[ns], table
                for key in old.keys() - table.keys():
                    self._notify(ns, key, None)
                for key, (_, value) in table.items():
                    if key not in old or old[key][1] != value:
                        self._notify(ns, key, value)
            self._epoch, self._version = epoch, int(counter or 0)
            self._position = _text(last[0][0]) if last else "0-0"
            self._seen, self._written = self._version, None
        self._load_needed, self._unpublished, self.healthy = False, False, True
        self.reloads += not first
        if back:
            log.info("shared_map_back keys=%d lost=%s", sum(map(len, self._data.values())), lost)

    def _notify(self, ns: str, key: str, value: bytes | None) -> None:
        if self.on_change is not None:
            try:
                self.on_change(ns, key, value)
            except Exception:
                log.exception("shared_map_on_change_failed ns=%s key=%s", ns, key)


def _text(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


def _decode(raw: bytes) -> tuple[int, bytes]:
    version, _, payload = raw.partition(b":")
    return int(version), payload


def _sid(i: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(i).partition("-")
    return int(ms), int(seq or 0)
