"""`Publishing.publish_failed` keeps a failure that happened while it wrote the same key."""

from __future__ import annotations

import asyncio
from typing import Any

from lpcache.errors import SharedStoreDown
from lpcache.fleet.publishing import Publishing
from lpcache.fleet.replica import FleetStats

KEY = "k" * 64


async def test_a_write_that_fails_while_publish_failed_writes_that_key_stays_unpublished() -> None:
    """K's delete failed once (one call timed out). publish_failed writes it again; meanwhile K is added anew (the
    same prompt saved again) and that batch fails too. The add must stay in `_unpublished`: else the replica counts
    itself in sync (`sweep_horizon`) while Redis names no K, and another replica's orphan sweep deletes K's file."""
    pub: Any = Publishing.__new__(Publishing)
    tasks: list[asyncio.Task[Any]] = []
    pub.spawn = lambda coro: tasks.append(asyncio.ensure_future(coro))
    pub.stats = FleetStats()
    pub._index_out = {}
    pub._unpublished = {("index", KEY)}

    class Index:
        def document(self, key: str) -> bytes | None:
            return None   # deleted when read

    class Map:
        async def delete(self, ns: str, key: str) -> None:
            pub.entry_changed(KEY, b'{"new": true}')   # saved again meanwhile
            await tasks[-1]                            # its batch is written (and fails) while this call runs
            # this call itself succeeds

        async def update(self, ns: str, puts: Any = None, deletes: Any = ()) -> None:
            raise SharedStoreDown("timeout")

    pub.index, pub.map = Index(), Map()
    await pub.publish_failed()
    await asyncio.gather(*tasks)
    assert ("index", KEY) in pub._unpublished, "the failed add of K was dropped: Redis never learns of K's file"
