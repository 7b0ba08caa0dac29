"""What a replica tells the others through the shared map, and what it takes from them: index entries (gathered and
written in batches), sessions' newest files, learnt speeds; and, when Redis comes back or lost its data, all that
this replica holds, written again (`republish`), its held slots' leases taken again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from lpcache.backends.backend import Backend
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Slot
from lpcache.cache.index import MetaIndex
from lpcache.cache.sessions import SessionBook, SessionInfo
from lpcache.cache.speeds import Rate, SpeedBook, Speeds
from lpcache.errors import SharedStoreDown
from lpcache.fleet.leases import PREFIX
from lpcache.fleet.shared_map import CALL_TIMEOUT, SharedMap
from lpcache.fleet.slot_state import content_doc

if TYPE_CHECKING:
    from lpcache.fleet.replica import FleetStats, _Held

log = logging.getLogger("lpcache.fleet")

SPEEDS_EVERY = 5.0             # seconds between two publications of one backend's speeds
SESSIONS_SHARED = 10_000       # session documents kept in Redis: past a tenth more, the oldest go


class Publishing:
    """The shared map's side of a replica (`replica.Fleet` is one, and sets all of this up)."""

    replica: str
    ttl_ms: int
    backends: list[Backend]
    pool: SlotPool
    index: MetaIndex
    sessions: SessionBook
    speeds: SpeedBook
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    client: Any
    map: SharedMap
    stats: FleetStats
    _republish: Any
    _held: dict[Slot, _Held]
    _fences: dict[str, int]
    _granted: dict[str, int]
    _index_out: dict[str, bytes | None]
    _pruning: bool
    _releasing: dict[str, asyncio.Event]
    _speeds_at: dict[str, float]
    _unleased: set[Slot]
    _unpublished: set[tuple[str, str]]
    _apply_slot: Callable[[str, bytes | None], None]
    _bounded: Callable[[], AbstractAsyncContextManager[None]]
    _reconcile: Callable[[Slot], None]

    def entry_changed(self, key: str, document: bytes | None) -> None:
        """The index added (its meta document) or removed an entry: tell the other replicas. The changes made
        before the loop turns (a new entry and the ones the limits removed for it) go in one write."""
        if not self._index_out:
            self.spawn(self._flush_index())
        self._index_out[key] = document

    async def _flush_index(self) -> None:
        batch, self._index_out = self._index_out, {}
        try:
            await self.map.update("index", puts={k: v for k, v in batch.items() if v is not None},
                                  deletes=[k for k, v in batch.items() if v is None])
            self._unpublished -= {("index", key) for key in batch}
        except Exception as e:   # never an unretrieved task error: written again when Redis is next back
            if not isinstance(e, SharedStoreDown):
                log.exception("shared_write_failed ns=index keys=%d", len(batch))
            self.stats.redis_errors += 1
            self._unpublished |= {("index", key) for key in batch}
        finally:
            self.stats.redis_calls += 1

    def session_saved(self, info: SessionInfo) -> None:
        latest = info.latest if info.latest is not None and info.latest < len(self.backends) else None
        doc = {"session": info.session, "route": info.route, "file": info.file, "owner": info.owner,
               "replica": self.replica,
               "file_bytes": info.file_bytes, "chain": list(info.saved_chain), "tokens": info.saved_tokens,
               "at": info.saved_at,   # wall clock: two saves of one session are seconds apart, clock skew less
               "homes": [self.backends[i].url for i in sorted(info.homes) if i < len(self.backends)],
               "latest": self.backends[latest].url if latest is not None else None}
        self.spawn(self._write("sessions", info.file, orjson.dumps(doc)))
        if self.map.count("sessions") > SESSIONS_SHARED * 1.1 and not self._pruning:
            self._pruning = True
            self.spawn(self._prune_sessions())

    async def _prune_sessions(self) -> None:
        """Keep SESSIONS_SHARED session documents in Redis: the least recently saved go (their files may still
        be on disk; a replica that meets the session again learns it from its own book)."""
        try:
            def when(item: tuple[str, bytes]) -> float:
                try:
                    at = orjson.loads(item[1]).get("at")
                except (orjson.JSONDecodeError, AttributeError):
                    return 0.0
                return float(at) if isinstance(at, (int, float)) else 0.0
            items = sorted(self.map.items("sessions"), key=when)
            old = [key for key, _ in items[:max(0, len(items) - SESSIONS_SHARED)]]
            for at in range(0, len(old), 256):
                await self.map.update("sessions", deletes=old[at:at + 256])
            log.info("sessions_pruned count=%d kept=%d", len(old), self.map.count("sessions"))
        except SharedStoreDown as e:
            log.warning("sessions_prune_failed: %s", e)
        finally:
            self._pruning = False

    def speeds_learnt(self, backend: int, model: str, speeds: Speeds) -> None:
        """Publish a backend's speeds, at most every SPEEDS_EVERY seconds: a new replica starts with them."""
        key = f"{self.backends[backend].url}\n{model}"
        now = time.monotonic()
        if now - self._speeds_at.get(key, -SPEEDS_EVERY) < SPEEDS_EVERY:
            return
        self._speeds_at[key] = now
        doc = {**speeds.describe(), "chars_per_token": speeds.chars_per_token}
        self.spawn(self._write("speeds", key, orjson.dumps(doc)))

    async def _write(self, ns: str, key: str, value: bytes | None) -> None:
        try:
            if value is None:
                await self.map.delete(ns, key)
            else:
                await self.map.put(ns, key, value)
            self._unpublished.discard((ns, key))
        except SharedStoreDown:
            self.stats.redis_errors += 1
            self._unpublished.add((ns, key))
        except Exception:   # never an unretrieved task error: written again when Redis is next back
            log.exception("shared_write_failed ns=%s key=%s", ns, key)
            self.stats.redis_errors += 1
            self._unpublished.add((ns, key))
        finally:
            self.stats.redis_calls += 1

    async def republish(self, lost: bool) -> None:
        """Redis answers again: write what failed meanwhile; when it lost its data, everything this replica knows
        first-hand (the index entries it has meta files of, the slots it last held, its sessions). The slots it
        used without a lease meanwhile are reconciled (`_reconcile`; one still in use, once it is given back).
        A slot's state is written again only by the replica its last known grant went to, and only over an older
        one (`REPUBLISH`): a replica that comes back late must not bring back what it believed before."""
        for slot in list(self._unleased):
            if not slot.busy and slot.name not in self._releasing:
                self._reconcile(slot)
        if lost:
            await self._leases_lost()
            for key, document in await asyncio.to_thread(self.index.documents):
                await self.map.put("index", key, document)
            for slot in self.pool.slots:
                if slot.content is not None and not slot.busy and slot.elsewhere is None \
                        and slot.name not in self._releasing \
                        and self._granted.get(slot.name, -1) == self._fences.get(slot.name):   # its own, as it left it
                    token = self._fences.get(slot.name, 0)
                    payload = orjson.dumps({"token": token, "replica": self.replica,
                                            "content": content_doc(slot.content)})
                    counter, stream, table = self.map.keys_of("slots")
                    try:
                        async with self._bounded():
                            await self._republish(keys=[counter, stream, table, PREFIX + slot.name],
                                                  args=[slot.name, payload, token, self.map.maxlen, self.replica])
                    except (RedisError, OSError) as e:
                        raise SharedStoreDown(f"Redis did not take a slot's state again: {e!r}") from e
            for info in self.sessions.all_owners():
                if info.saved_chain and info.saved_here:   # first-hand: another replica's save is its to write
                    self.session_saved(info)
            self._unpublished.clear()
            return
        await self.publish_failed()

    async def publish_failed(self) -> None:
        """Write again what failed to be written (Redis down, or one call that timed out while it stayed up)."""
        for ns, key in sorted(self._unpublished):
            self._unpublished.discard((ns, key))   # before the write: a failure meanwhile marks it again
            try:
                if ns == "index":
                    found = await asyncio.to_thread(self.index.document, key)
                    await (self.map.put(ns, key, found) if found is not None else self.map.delete(ns, key))
                elif ns == "sessions" and (known := self.sessions.get(key)) is not None:
                    self.session_saved(known)
            except BaseException:
                self._unpublished.add((ns, key))
                raise

    async def _leases_lost(self) -> None:
        """Redis lost its data, the leases with it. This replica's requests still in a slot take their leases
        again (only where no other replica claimed the slot since: a claim is then refused by Redis, not by timing).
        A slot it saw held by another replica (`elsewhere`) is believed held a bounded time more, not the lease's
        whole time it last saw: a live holder learns its lease is gone by its next renewal (a third of the ttl on,
        within a call's time) and then writes nothing, and a holder whose release Redis never took says so again as
        it notices Redis is back (`republish`); one that never comes back frees it then. What such a slot holds is
        unknown meanwhile (its holder's word went with Redis)."""
        for slot, held in list(self._held.items()):
            if held.lease.valid() and not held.lease.released:
                with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                    async with self._bounded():
                        await self.client.set(PREFIX + slot.name, held.lease.value, nx=True, px=self.ttl_ms)
        bound = time.monotonic() + self.ttl_ms / 3000 + CALL_TIMEOUT
        soonest = None
        for slot in self.pool.slots:
            if slot.elsewhere is not None and not slot.busy and slot.elsewhere_until > bound:
                slot.elsewhere_until, slot.content = bound, None
                soonest = bound
        if soonest is not None:
            asyncio.get_running_loop().call_later(max(soonest - time.monotonic(), 0.0) + 0.01, self.pool.wake)

    def on_change(self, ns: str, key: str, value: bytes | None) -> None:
        """Another replica's change (or a reload's difference) into this replica's objects."""
        if ns == "slots":
            self._apply_slot(key, value)
        elif ns == "index":
            self.index.apply(key, value)
        elif ns == "sessions":
            self._apply_session(key, value)
        elif ns == "speeds":
            self._apply_speeds(key, value)

    def _apply_session(self, file: str, value: bytes | None) -> None:
        if value is None:
            return
        try:
            doc = orjson.loads(value)
            urls = set(doc.get("homes") or ())
            info = self.sessions.known(file, str(doc["session"]), str(doc["route"]), doc.get("owner"))
            info.homes |= {b.index for b in self.backends if b.url in urls}
            at = float(doc.get("at") or 0)
            if at < info.saved_at:
                return   # an older save than the one this replica knows (written again after Redis lost its data)
            info.saved_chain = tuple(int(d) for d in doc.get("chain") or ())
            info.file_bytes = doc.get("file_bytes")
            tokens = doc.get("tokens")
            info.saved_tokens = tokens if isinstance(tokens, int) and tokens > 0 else None
            info.saved_at, info.saved_here = at, doc.get("replica") == self.replica
            info.latest = next((b.index for b in self.backends if b.url == doc.get("latest")), None)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            log.debug("session_doc_skipped file=%s", file)

    def _apply_speeds(self, key: str, value: bytes | None) -> None:
        url, _, model = key.partition("\n")
        backend = next((b for b in self.backends if b.url == url), None)
        if backend is None or value is None:
            return
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:
            return
        speeds = self.speeds.of(backend.index, model)
        for name, rate in (("prefill", speeds.prefill), ("restore", speeds.restore),
                           ("generate", speeds.generate), ("save", speeds.save)):
            adopt_rate(rate, doc.get(f"{name}_ms_per_token"))
        cpt = doc.get("chars_per_token")
        if speeds.chars_per_token is None and isinstance(cpt, (int, float)) and cpt > 0:
            speeds.chars_per_token = float(cpt)

    @staticmethod
    async def _quietly(call: Coroutine[Any, Any, Any]) -> None:
        with contextlib.suppress(SharedStoreDown):
            await call


def adopt_rate(rate: Rate, value: Any) -> None:
    """Another replica's measure of a rate this replica has not measured yet."""
    if rate.ms_per_token is None and isinstance(value, (int, float)) and value > 0:
        rate.ms_per_token = float(value)
