"""Slot leases across lpcache replicas: one request of one replica uses a slot at a time, through a lease in Redis.

A lease is the key `lpcache:lease:<name>` (name: `<backend url>#<slot id>`) whose value is
`<token> <replica> <request>`, set with a Redis expiry, so a crashed replica's leases vanish by themselves. Every
grant takes a fencing token from one counter, `lpcache:lease:token`, floored at Redis's clock in microseconds: tokens
strictly increase across grants, and stay above every earlier token even when Redis restarts without its data
(docs/scale-out.md). Each operation is one Lua script, so no check and set can interleave with another replica's.
The holder believes its lease only until a local deadline taken before the call was sent (less a drift margin), so
it stops writing before Redis could grant the slot to anyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from lpcache.errors import LpcacheError, SharedStoreDown

log = logging.getLogger("lpcache.leases")

PREFIX = "lpcache:lease:"
COUNTER = PREFIX + "token"

# The grant, shared with the fleet's claim: a token from the counter KEYS[2], floored at Redis's clock in
# microseconds, and the lease KEYS[1] set to `<token> ARGV[1]` for ARGV[2] ms; `text` is the token.
GRANT = """
local token = redis.call('INCR', KEYS[2])
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
if token < floor then
  token = floor
  redis.call('SET', KEYS[2], string.format('%.0f', token))
end
local text = string.format('%.0f', token)
redis.call('SET', KEYS[1], text .. ' ' .. ARGV[1], 'PX', ARGV[2])
"""
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
""" + GRANT + """
return text
"""
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
_HOLDER = """
local value = redis.call('GET', KEYS[1])
if not value then return false end
return {value, redis.call('PTTL', KEYS[1])}
"""


class LeaseTaken(LpcacheError):
    """Another holder has a live lease on the slot."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lease: a replica (no spaces: it is the value's separator) and one of its requests."""

    replica: str
    request: str

    def __post_init__(self) -> None:
        if not self.replica or " " in self.replica:
            raise ValueError(f"a replica id is one word, not {self.replica!r}")

    def __str__(self) -> str:
        return f"{self.replica} {self.request}"


def drift(ttl_ms: int) -> float:
    """Seconds a holder gives up before its ttl ends: clock rates and Redis's 1 ms expiry resolution (Redlock's)."""
    return ttl_ms * 0.01 / 1000 + 0.002


@dataclass(eq=False)
class Lease:
    """A granted lease. `expires` (time.monotonic) moves on with each renewal; `lost` is set when the keeper learns
    the lease is gone. A writer checks `valid()` right before it writes, and presents `token`."""

    name: str
    holder: Holder
    token: int
    ttl_ms: int
    expires: float
    lost: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    released: bool = False   # set by `release`: no renewal may extend it afterwards

    @property
    def value(self) -> str:
        return f"{self.token} {self.holder}"

    def valid(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.expires


class Leases:
    """The lease operations on one Redis client. `timeout` bounds each call whatever the client's own settings
    (give the client short socket timeouts and few retries too, so that a call gives up rather than waits)."""

    def __init__(self, redis: Redis, *, timeout: float = 1.0) -> None:
        self.redis = redis
        self.timeout = timeout
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._holder = redis.register_script(_HOLDER)
        kwargs = redis.connection_pool.connection_kwargs
        self._where = f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        self._releasing: set[asyncio.Task[bool]] = set()

    async def _run(self, what: str, script: Any, name: str, *args: Any, counter: bool = False) -> Any:
        if name == "token" or not name:
            raise ValueError(f"{name!r} is not a slot name (`<backend url>#<slot id>`)")
        keys = [PREFIX + name, COUNTER] if counter else [PREFIX + name]
        task = asyncio.current_task()
        cancels = task.cancelling() if task else 0
        try:
            try:
                async with asyncio.timeout(self.timeout):
                    result = await script(keys=keys, args=args)
            except TimeoutError:
                # cut short mid-call, a connection may be left a reply behind: none is used again
                await self.redis.connection_pool.disconnect()
                raise
        except (RedisError, OSError) as e:   # OSError: TimeoutError from asyncio.timeout, and socket errors
            raise SharedStoreDown(f"Redis at {self._where} did not answer a lease {what} on {name!r} within "
                                  f"{self.timeout:g}s: {e!r}") from e
        if task is not None and task.cancelling() > cancels:
            raise asyncio.CancelledError()   # redis-py's asyncio.wait_for swallows a cancel on Python 3.11
        return result

    async def acquire(self, name: str, holder: Holder, ttl_ms: int) -> Lease | None:
        """The lease on `name` for `ttl_ms`, or None while someone else's is live."""
        sent = time.monotonic()
        token = await self._run("acquire", self._acquire, name, str(holder), ttl_ms, counter=True)
        if token is None:
            return None
        return Lease(name, holder, int(token), ttl_ms, sent + ttl_ms / 1000 - drift(ttl_ms))

    async def renew(self, lease: Lease, ttl_ms: int | None = None) -> bool:
        """Extend a lease still held with its token, from now; False when it expired, another holder has it, or
        it was released (even while this call was on its way)."""
        ttl_ms = lease.ttl_ms if ttl_ms is None else ttl_ms
        sent = time.monotonic()
        if lease.released or not await self._run("renew", self._renew, lease.name, lease.value, ttl_ms) \
                or lease.released:   # released while the answer was on its way
            return False
        lease.ttl_ms, lease.expires = ttl_ms, sent + ttl_ms / 1000 - drift(ttl_ms)
        return True

    async def release(self, lease: Lease) -> bool:
        """Give the slot up; False (and nothing deleted) when the lease is no longer this one, e.g. it expired and
        was granted again. The holder stops believing in it at once, before Redis forgets it."""
        lease.released, lease.expires = True, min(lease.expires, time.monotonic())
        return bool(await self._run("release", self._release, lease.name, lease.value))

    async def holder(self, name: str) -> Lease | None:
        """The live lease on `name` as Redis sees it (who, token, time left), or None."""
        sent = time.monotonic()
        found = await self._run("read", self._holder, name)
        if found is None:
            return None
        token, replica, request = found[0].decode().split(" ", 2)
        return Lease(name, Holder(replica, request), int(token), found[1], sent + found[1] / 1000)

    @asynccontextmanager
    async def hold(self, name: str, holder: Holder, ttl_ms: int) -> AsyncIterator[Lease]:
        """Hold `name` while the block runs: acquired (or `LeaseTaken`), renewed every third of its ttl, released on
        the way out whatever ends the block. A crash stops the renewals, so the lease lapses within `ttl_ms`."""
        acquiring = asyncio.ensure_future(self.acquire(name, holder, ttl_ms))
        try:
            lease = await asyncio.shield(acquiring)
        except asyncio.CancelledError:   # Redis may grant it all the same: give it back then, not at its ttl
            acquiring.add_done_callback(self._give_back)
            raise
        if lease is None:
            raise LeaseTaken(f"slot {name} is leased to another request")
        stop = asyncio.Event()
        keeper = asyncio.create_task(self.keep(lease, stop), name=f"lease keeper {name}")
        try:
            yield lease
        finally:
            stop.set()      # not keeper.cancel(): a cancel inside redis-py can be swallowed (above)
            await asyncio.wait([self._released(lease), keeper])   # a second cancel leaves both to finish

    async def keep(self, lease: Lease, stop: asyncio.Event, first: float | None = None) -> None:
        """Renew until stopped; set `lost` when Redis says the lease is gone, or when it lapsed unrenewed (Redis
        down), since then another replica may hold it."""
        every = lease.ttl_ms / 3000
        wait = every if first is None else first   # `first`: seconds to the first renewal (the caller waited)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(wait, lease.expires - time.monotonic()))):
                    await stop.wait()
            wait = every
            if stop.is_set() or lease.released:
                return
            if time.monotonic() >= lease.expires:
                break
            try:
                if not await self.renew(lease):
                    break
            except SharedStoreDown as e:
                log.warning("lease: renewal failed, retrying until the lease lapses: %s", e)
        if not lease.released:
            log.warning("lease: %s lost (token %d)", lease.name, lease.token)
            lease.lost.set()

    def _give_back(self, acquiring: asyncio.Future[Lease | None]) -> None:
        if not acquiring.cancelled() and acquiring.exception() is None and (lease := acquiring.result()):
            self._released(lease)

    def _released(self, lease: Lease) -> asyncio.Task[bool]:
        """The release in a task of its own, kept until done: a failure is harmless (the lease lapses by its ttl)
        but worth a warning, and must not raise over whatever ended the holder's block."""
        task = asyncio.create_task(self.release(lease))
        self._releasing.add(task)

        def done(task: asyncio.Task[bool]) -> None:
            self._releasing.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("lease: release failed, it will lapse by itself: %s", task.exception())
        task.add_done_callback(done)
        return task
