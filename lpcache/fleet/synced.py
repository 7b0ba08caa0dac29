"""Up to when every replica's saves are in Redis: what the orphan sweep may judge (`cache.orphans`).

A replica cut off from Redis (its link down, the others' fine) goes on saving, and names its new files only in its
own index until it is back. Another replica's sweep sees such a file named by no entry it knows. So each replica
writes, at every sweep period while it is in sync (Redis reachable, none of its index changes waiting), the wall
time it was so: `<prefix>:synced` (a hash, replica id -> time). Every file a replica named before that time is
in Redis. The sweep judges only files written before the oldest of these times (less SLACK_SECONDS: an entry is
written just after its file, and hosts' clocks differ a little).

A replica not heard of for GONE_AFTER (4 grace periods, 10 minutes at least) is taken as gone, and forgotten: a
replica that stays cut off longer loses this protection. Redis restarted without its data forgets every replica;
the sweep then waits one grace period (the hash's `*since`) for the live replicas to write again what they own and
when they were in sync.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

SLACK_SECONDS = 30.0
GONE_MIN_SECONDS = 600.0
SINCE = "*since"   # the hash's own field: when it was (re)created


def gone_after(grace: float) -> float:
    return max(4 * grace, GONE_MIN_SECONDS)


class SyncedTimes:
    """This replica's entry in `<prefix>:synced`, and the sweep's horizon from all of them."""

    def __init__(self, client: aioredis.Redis, prefix: str, replica: str) -> None:
        self.client = client
        self.key = f"{prefix}:synced"
        self.replica = replica

    async def horizon(self, grace: float, in_sync: bool) -> float | None:
        """The wall time before which a file no entry names may be deleted; None: no sweep now (this replica is
        not in sync, Redis does not answer, or it lost its data less than a grace period ago)."""
        if not in_sync:
            return None
        now = time.time()
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self.key, self.replica, repr(now))
            pipe.hsetnx(self.key, SINCE, repr(now))
            pipe.hgetall(self.key)
            *_, raw = await pipe.execute()
            times = {_text(k): float(v) for k, v in raw.items()}
            gone = [k for k, t in times.items() if k != SINCE and now - t > gone_after(grace)]
            if gone:
                await self.client.hdel(self.key, *gone)
        except (RedisError, OSError, ValueError):
            return None
        if now - times.get(SINCE, now) < grace:
            return None
        return min(t for k, t in times.items() if k != SINCE and k not in gone) - SLACK_SECONDS


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
