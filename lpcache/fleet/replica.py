"""Several lpcache replicas as one (REDIS_URL): slot leases, and the cache map they share through Redis.

Each replica keeps deciding alone, from its own memory, as fast as one process does; Redis makes that memory the
same everywhere (docs/scale-out.md):

- **Slot leases.** A slot the pool hands out is claimed (`claim`) before anything is sent to it: one Lua script takes
  the lease (an expiry, a fencing token; renewed every third of SLOT_LEASE_MS while held) and reads what the slot
  holds as its last holder left it. A slot another replica holds is passed over and marked `elsewhere` until its
  lease's expiry, or until its holder gives it back. Giving it back (`released`) is one script too: the slot's new
  content is written to the shared map and the lease deleted together, only while the lease is still this one's
  (a holder that lost its lease writes nothing). So what a slot holds is known to whoever holds it next: the last
  holder's word, when the last grant was that holder's; else (a holder that died mid-request) unknown.
- **The shared map** (`shared_map.SharedMap`): the index of saved caches (`index`: each entry's meta document), what
  each slot holds (`slots`), the sessions' files (`sessions`) and the learnt speeds (`speeds`), mirrored in every
  replica's memory. This module turns the map's changes into the local objects' changes and back.
- **Redis down.** Every replica keeps serving on its own: a claim is then a local decision (counted, warned once),
  nothing shared is written, and when Redis is back each replica writes again what it holds (`republish`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import orjson
from redis.exceptions import RedisError

from lpcache.backends.backend import Backend
from lpcache.backends.placement import Want
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content, Slot
from lpcache.cache.index import MetaIndex
from lpcache.cache.sessions import SessionBook
from lpcache.cache.speeds import SpeedBook
from lpcache.config import shown_url
from lpcache.errors import SharedStoreDown
from lpcache.fleet.leases import COUNTER, PREFIX, Holder, Lease, Leases, drift
from lpcache.fleet.publishing import Publishing
from lpcache.fleet.shared_map import CALL_TIMEOUT, SharedMap, connect
from lpcache.fleet.slot_state import CLAIM, RELEASE, REPUBLISH, content_doc, content_of, pending_doc, text, trusted
from lpcache.fleet.synced import SyncedTimes

log = logging.getLogger("lpcache.fleet")

NAMESPACES = ("index", "slots", "sessions", "speeds")
GRANTED = PREFIX + "granted"   # hash: slot name -> the last token granted on it
# Seconds a slot this replica gives back keeps its lease, in case this replica's next request wants it (an agent's
# next turn, sent the moment the answer ends): that request then takes it over, no round trip on its way.
HANDOVER = 0.005
SAVE_TOLD_AFTER = 0.02         # seconds a save lasts before the other replicas are told of it
# For RESTART_WINDOW seconds after Redis went down, a claim first gives it RESTART_WAIT seconds to answer again (the
# follower tries at once): a Redis restarted by its supervisor is back within them, and no replica decides alone,
# when two replicas deciding alone could use one slot at once (and save one conversation's cache under another's
# name). Past the window, claims are local decisions at once.
RESTART_WINDOW = 10.0
RESTART_WAIT = 0.3

@dataclass(eq=False)
class _Held:
    lease: Lease
    stop: asyncio.Event
    renewals: asyncio.TimerHandle | None = None  # starts the keeper a third of the ttl on (most requests end sooner)
    keeper: asyncio.Task[None] | None = None
    save_told: asyncio.TimerHandle | None = None   # tells the other replicas the save phase, if it lasts
    pending: bytes = b"null"                       # what the slot's state says its request will leave there
    handover: asyncio.TimerHandle | None = None    # given back: the lease goes when this fires (`HANDOVER`)
    content: bytes = b""                           # given back: the state its release writes


@dataclass
class FleetStats:
    """For /metrics and the benchmark."""

    redis_calls: int = 0          # round trips to Redis on a request's way (claims) and after it (releases)
    redis_errors: int = 0         # calls that failed: Redis down or too slow
    local_claims: int = 0         # slots taken without a lease because Redis was down
    claims_refused: int = 0       # slots another replica held when this one chose them
    handovers: int = 0            # slots taken over from this replica's previous request, no round trip
    claim_seconds: float = 0.0    # time spent in claims (added latency)


class Fleet(Publishing):
    """This replica's part of the fleet: its leases, and the mirror of what every replica published."""

    def __init__(self, url: str, replica: str, ttl_ms: int, backends: Sequence[Backend], pool: SlotPool,
                 index: MetaIndex, sessions: SessionBook, speeds: SpeedBook,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None], prefix: str = "lpcache",
                 ring_files: int = 32) -> None:
        self.url = url
        self.prefix = prefix
        self.ring_files = ring_files
        self.replica = replica
        self.ttl_ms = ttl_ms
        self.backends = list(backends)
        self.pool = pool
        self.index = index
        self.sessions = sessions
        self.speeds = speeds
        self.spawn = spawn
        self.client = connect(url)
        self.leases = Leases(self.client, timeout=CALL_TIMEOUT)
        # a reconnection is tried every second at most: a replica that still decides alone while the others lease
        # again is the one gap in the slots' exclusion (docs/scale-out.md, Failures)
        self.map = SharedMap(self.client, NAMESPACES, replica, self.on_change, on_reconnect=self.republish,
                             prefix=prefix, own_applied=("slots",), gather=0.02, backoff=(0.1, 1.0))
        self.synced = SyncedTimes(self.client, prefix, replica)
        self._claim = self.client.register_script(CLAIM)
        self._republish = self.client.register_script(REPUBLISH)
        self._release = self.client.register_script(RELEASE)
        self._held: dict[Slot, _Held] = {}
        self._handing: dict[Slot, _Held] = {}   # given back, lease kept for HANDOVER seconds
        self._stopping = False
        self._releasing: dict[str, asyncio.Event] = {}   # slot name -> set once its release is done
        self._fences: dict[str, int] = {}        # slot name -> the highest token whose state this replica applied
        self._granted: dict[str, int] = {}       # slot name -> the last token granted to this replica on it
        self._unpublished: set[tuple[str, str]] = set()   # (ns, key) whose write failed while Redis was down
        self._index_out: dict[str, bytes | None] = {}   # index changes not written yet (`entry_changed`)
        self._unleased: set[Slot] = set()        # slots used without a lease (Redis down), to reconcile when back
        self._pruning = False
        self._speeds_at: dict[str, float] = {}
        self._requests = count(1)
        self._warned = False
        self.stats = FleetStats()
        index.publish = self.entry_changed
        index.in_use_elsewhere = self.files_in_use
        index.named_elsewhere = self.names
        sessions.on_saved = self.session_saved
        speeds.on_learnt = self.speeds_learnt
        pool.claims = self

    @contextlib.asynccontextmanager
    async def _bounded(self) -> AsyncIterator[None]:
        """CALL_TIMEOUT around a Redis call; when it cuts the call short, the pool's connections are dropped (one
        may be a reply behind, and would hand that reply to the next call)."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                yield
        except TimeoutError:
            await self.client.connection_pool.disconnect()
            raise

    @property
    def healthy(self) -> bool:
        return self.map.healthy

    async def sweep_horizon(self, grace: float) -> float | None:
        """Before when the orphan sweep may judge files (`synced`); None: no sweep now. What failed to be written
        while Redis stayed up (one call timed out) is written first: no reconnect would."""
        if self.healthy and self._unpublished:
            try:
                await self.publish_failed()
            except (SharedStoreDown, RedisError, OSError) as e:
                log.info("sweep_waits: what failed to be written to Redis still is (%s)", e)
        return await self.synced.horizon(grace, self.healthy and not self._unpublished and not self._index_out)

    def names(self, key: str) -> bool:
        """Whether the shared index has an entry named `key`, one this replica could read or not (a newer
        lpcache's): its file is no orphan."""
        return self.map.get("index", key) is not None

    async def start(self) -> None:
        """Load the shared map (every replica's entries join the local index), then add this replica's own entries
        Redis does not have (its META_DIR, read at start)."""
        await self.map.start()
        if not self.map.healthy:
            log.warning("redis_unreachable url=%s: serving on local decisions until it answers", shown_url(self.url))
            return
        missing = [(key, doc) for key, doc in await asyncio.to_thread(self.index.documents)
                   if self.map.get("index", key) is None]
        try:
            for at in range(0, len(missing), 256):
                await self.map.update("index", puts=dict(missing[at:at + 256]))
        except SharedStoreDown as e:
            log.warning("index_publish_failed entries=%d: %s", len(missing), e)
        log.info("fleet_start replica=%s redis=%s shared_entries=%d published=%d", self.replica, shown_url(self.url),
                 self.map.count("index"), len(missing))

    async def stop(self) -> None:
        self._stopping = True
        for slot in list(self._held):
            self.released(slot)
        for slot, held in list(self._handing.items()):
            self._give_up(slot, held)
        if self._releasing:
            await asyncio.wait([asyncio.ensure_future(e.wait()) for e in self._releasing.values()],
                               timeout=2 * CALL_TIMEOUT)
        await self.map.stop()
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()

    # ---- slots ----

    async def claim(self, slot: Slot, want: Want | None = None, restore: str | None = None,
                    writes: Content | None = None) -> bool:
        """Take the slot's lease for this replica: True when it is this replica's now (or Redis is down: a local
        decision), False when another replica's request holds it (the slot is then marked `elsewhere`). The other
        replicas are told what the request will leave in the slot and the file it restores first (`restore`), or the
        cache lpcache's own save of the slot `writes`: no such file is deleted by their limits meanwhile
        (`files_in_use`)."""
        handed = self._handing.pop(slot, None)
        if handed is not None:
            if self._take_over(slot, handed, pending_doc(want, restore, slot, writes)):
                return True
            self._give_up(slot, handed)
        releasing = self._releasing.get(slot.name)
        if releasing is not None:   # this replica's own release of it is on its way
            await releasing.wait()
        if self.map.down and not (self.map.down_for() < RESTART_WINDOW and await self.map.back_within(RESTART_WAIT)):
            self._local(slot, "redis down")
            return True
        started = time.perf_counter()
        sent = time.monotonic()
        holder = Holder(self.replica, f"{next(self._requests):x}")
        pending = pending_doc(want, restore, slot, writes)
        call = asyncio.ensure_future(self._claim_call(slot, holder, pending))
        try:
            answer = await asyncio.shield(call)
        except asyncio.CancelledError:   # Redis may grant it all the same: give it back at once, not at its ttl
            call.add_done_callback(lambda c: self._give_back_granted(c, slot, holder, sent))
            raise
        except SharedStoreDown as e:
            self.stats.redis_errors += 1
            self._local(slot, str(e))
            return True
        finally:
            self.stats.redis_calls += 1
            self.stats.claim_seconds += time.perf_counter() - started
        token = int(answer[0])
        if not token:
            self.stats.claims_refused += 1
            self._elsewhere(slot, "another replica", int(answer[1]) / 1000)
            return False
        before, state = answer[1], answer[2]
        lease = Lease(slot.name, holder, token, self.ttl_ms, sent + self.ttl_ms / 1000 - drift(self.ttl_ms))
        self._learn_holding(slot, text(before), text(state))
        self._fences[slot.name] = token   # what any replica wrote of the slot before this grant is older than now
        self._granted[slot.name] = token
        stop = asyncio.Event()
        held = _Held(lease, stop, pending=orjson.dumps(pending))
        held.renewals = asyncio.get_running_loop().call_later(self.ttl_ms / 3000, self._start_keeper, slot.name, held)
        self._held[slot] = held
        slot.elsewhere = None
        return True

    async def _claim_call(self, slot: Slot, holder: Holder, pending: dict[str, Any] | None) -> list[Any]:
        counter, stream, table = self.map.keys_of("slots")
        try:
            async with self._bounded():
                return await self._claim(  # type: ignore[no-any-return]
                    keys=[PREFIX + slot.name, COUNTER, GRANTED, table, counter, stream],
                    args=[str(holder), self.ttl_ms, slot.name, self.replica, self.map.maxlen,
                          orjson.dumps(pending)])
        except (RedisError, OSError) as e:
            raise SharedStoreDown(f"Redis did not answer a slot claim on {slot.name}: {e!r}") from e

    def _give_back_granted(self, call: asyncio.Future[list[Any]], slot: Slot, holder: Holder, sent: float) -> None:
        """A claim whose request left while Redis answered: when it was granted, the slot goes back at once, its
        state as the claim found it (the claim wrote it busy: left so, the other replicas would wait for it)."""
        if call.cancelled() or call.exception() is not None:
            return
        answer = call.result()
        token = int(answer[0])
        if not token:
            return
        found = trusted(text(answer[1]), text(answer[2]))
        held = _Held(Lease(slot.name, holder, token, self.ttl_ms, sent), asyncio.Event())
        payload = orjson.dumps({"token": token, "replica": self.replica,
                                "content": found.get("content") if found else None})
        done = self._releasing[slot.name] = asyncio.Event()
        self.spawn(self._give_back(slot.name, held, payload, done))

    def _learn_holding(self, slot: Slot, before: str, state: str) -> None:
        """What the slot holds now that this replica has it: the map's state, when its writer was the last holder
        granted the slot (else that holder died mid-request, or lost its lease: unknown). A state no holder wrote
        yet leaves this replica's own belief."""
        if not state:
            return
        doc = trusted(before, state)
        if doc is None:
            if slot.content is not None:
                log.info("slot_content_unknown slot=%s: its last holder never said what it left (it stopped "
                         "mid-request)", slot.name)
            slot.content = None
            return
        self._fences[slot.name] = max(self._fences.get(slot.name, 0), int(doc.get("token") or 0))
        if doc.get("replica") != self.replica or slot.content is None:
            slot.content = content_of(doc.get("content"))

    def _start_keeper(self, name: str, held: _Held) -> None:
        """The request holds the slot a third of the lease's ttl on: renew it from now on, until released (the
        keeper's first renewal comes a third of the ttl after the grant)."""
        if not held.stop.is_set():
            held.keeper = asyncio.create_task(self.leases.keep(held.lease, held.stop, first=0.0),
                                              name=f"lease keeper {name}")

    def _take_over(self, slot: Slot, held: _Held, pending: dict[str, Any] | None) -> bool:
        """This replica's previous request gave the slot back a moment ago and its lease is still live: the new
        request holds it on (same lease, still renewed). The other replicas are told what it will leave there
        when that changed (off the request's way)."""
        if held.handover is not None:
            held.handover.cancel()
        if not held.lease.valid():
            return False
        held.handover = None
        self._held[slot] = held
        slot.elsewhere = None
        self.stats.handovers += 1
        doc = orjson.dumps(pending)
        if doc != held.pending:
            held.pending = doc
            self.spawn(self._write_state(slot.name, held, b'{"token":%d,"replica":"%s","busy":true,"pending":%s}' % (
                held.lease.token, self.replica.encode(), doc)))
        return True

    def released(self, slot: Slot) -> None:
        """The pool gave the slot back: write what it holds and give the lease up, in one script, off the request's
        way (a claim of the same slot by this replica waits for it), after HANDOVER seconds in which a request of
        this replica may take the slot over."""
        held = self._held.pop(slot, None)
        if held is None:
            if slot in self._unleased and not self.map.down and slot.name not in self._releasing:
                self._reconcile(slot)
            return
        if held.save_told is not None:
            held.save_told.cancel()
            held.save_told = None
        held.content = orjson.dumps({"token": held.lease.token, "replica": self.replica,
                                     "content": content_doc(slot.content)})
        if self._stopping or not held.lease.valid():
            self._give_up(slot, held)
            return
        self._handing[slot] = held
        held.handover = asyncio.get_running_loop().call_later(HANDOVER, self._give_up, slot, held)

    def _give_up(self, slot: Slot, held: _Held) -> None:
        if self._handing.get(slot) is held:
            del self._handing[slot]
        if held.handover is not None:
            held.handover.cancel()
        held.stop.set()
        if held.renewals is not None:
            held.renewals.cancel()
        done = self._releasing[slot.name] = asyncio.Event()
        self.spawn(self._give_back(slot.name, held, held.content, done))

    async def _give_back(self, name: str, held: _Held, payload: bytes, done: asyncio.Event) -> None:
        lease = held.lease
        lease.released = True
        try:
            why = await self._write_state(name, held, payload, release=True)
            if why is None:
                self._fences[name] = max(self._fences.get(name, 0), lease.token)
            elif why == "lease_no_longer_held":
                log.warning("slot_release_failed slot=%s reason=%s: what this replica left there is not told to the "
                            "others; they learn it from the next holder or GET /slots", name, why)
            else:
                log.warning("slot_release_failed slot=%s reason=%s; its lease lapses within %d ms", name, why,
                            self.ttl_ms)
        finally:
            done.set()
            if self._releasing.get(name) is done:
                del self._releasing[name]
            if held.keeper is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([held.keeper])

    def _reconcile(self, slot: Slot) -> None:
        """A slot used without a lease while Redis was down: what the others believe it holds may be stale, and so
        may this replica's own belief (another replica may have used it meanwhile). Its shared state becomes
        "unknown" under a new grant, and this replica asks the server (`slot_truth`) before trusting its belief."""
        self._unleased.discard(slot)
        if slot.backend < len(self.backends):
            self.backends[slot.backend].suspect = True
        done = self._releasing[slot.name] = asyncio.Event()   # this replica's claims of it wait for this
        self.spawn(self._unknown(slot, done))

    async def _unknown(self, slot: Slot, done: asyncio.Event) -> None:
        try:
            holder = Holder(self.replica, f"{next(self._requests):x}")
            sent = time.monotonic()
            try:
                answer = await self._claim_call(slot, holder, None)
            except SharedStoreDown:
                self.stats.redis_errors += 1
                self._unleased.add(slot)   # again at the next reconnection
                return
            finally:
                self.stats.redis_calls += 1
            token = int(answer[0])
            if not token:
                return   # another replica holds it now: its release will say what it holds
            held = _Held(Lease(slot.name, holder, token, self.ttl_ms, sent), asyncio.Event())
            payload = orjson.dumps({"token": token, "replica": self.replica, "content": None})
            if await self._write_state(slot.name, held, payload, release=True) is None:
                self._fences[slot.name] = max(self._fences.get(slot.name, 0), token)
        finally:
            done.set()
            if self._releasing.get(slot.name) is done:
                del self._releasing[slot.name]

    def _elsewhere(self, slot: Slot, replica: str, seconds: float) -> None:
        """Another replica holds the slot, for `seconds` at most (its lease's time left): the requests waiting here
        are woken when that passes (its holder may be gone: its lease lapses, nobody gives the slot back)."""
        slot.elsewhere, slot.elsewhere_until = replica, time.monotonic() + max(seconds, 0.0)
        asyncio.get_running_loop().call_later(max(seconds, 0.0) + 0.01, self.pool.wake)

    def saving(self, slot: Slot) -> None:
        """The request in the slot is over and its cache is being saved: the other replicas' requests for what it
        holds may wait for it (`placement.wait_plan`: a slot being saved is worth waiting for). Told once the save
        lasts SAVE_TOLD_AFTER: the release of a quicker one says all there is to say, one round trip fewer."""
        held = self._held.get(slot)
        if held is not None and held.save_told is None:
            held.save_told = asyncio.get_running_loop().call_later(SAVE_TOLD_AFTER, self._tell_saving, slot, held)

    def _tell_saving(self, slot: Slot, held: _Held) -> None:
        if self._held.get(slot) is not held:
            return
        payload = orjson.dumps({"token": held.lease.token, "replica": self.replica, "busy": True, "phase": "save",
                                "pending": content_doc(slot.pending)})   # its answer is over
        self.spawn(self._write_state(slot.name, held, payload))

    async def _write_state(self, name: str, held: _Held, payload: bytes, release: bool = False) -> str | None:
        """The slot's state written the map's way while the lease is still `held`'s (and the lease deleted with
        `release`): one script. None when written, else why not: Redis did not answer, or the lease is no longer
        this replica's (it lapsed while Redis was out of reach, or Redis lost it), so nothing was written."""
        counter, stream, table = self.map.keys_of("slots")
        try:
            async with self._bounded():
                written = await self._release(keys=[PREFIX + name, counter, stream, table],
                                              args=[held.lease.value, self.replica, self.map.maxlen, name, payload,
                                                    "1" if release else "0"])
        except (RedisError, OSError) as e:
            self.stats.redis_errors += 1
            return f"redis_error ({e!r})"
        finally:
            self.stats.redis_calls += 1
        return None if written else "lease_no_longer_held"


    def valid(self, slot: Slot) -> bool:
        """Whether this replica may still act on the slot (restore, save): its lease is live, or it took the slot
        while Redis was down."""
        held = self._held.get(slot)
        return held is None or held.lease.valid()

    def _local(self, slot: Slot, why: str) -> None:
        self.stats.local_claims += 1
        self._unleased.add(slot)
        if not self._warned:
            self._warned = True
            log.warning("slot_claims_local reason=%s: Redis is unreachable; slots are taken on this replica's "
                        "word alone until it is back", why)

    def _apply_slot(self, name: str, value: bytes | None) -> None:
        slot = next((s for s in self.pool.slots if s.name == name), None)
        if slot is None or slot.busy or value is None:
            return
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:
            return
        token = doc.get("token") if isinstance(doc, dict) else None
        if not isinstance(token, int) or token < self._fences.get(name, 0):
            return   # older than what this replica already knows of the slot (a fenced, stale writer)
        self._fences[name] = token
        if doc.get("busy"):   # claimed: by another replica (this one's own claims are applied when made)
            if doc.get("replica") != self.replica:
                self._elsewhere(slot, str(doc.get("replica")), self.ttl_ms / 1000)
                pending = doc.get("pending")
                slot.pending = content_of(pending)
                slot.phase = str(doc.get("phase") or "")
                answer = pending.get("answer_tokens") if isinstance(pending, dict) else None
                slot.answer_tokens = answer if isinstance(answer, int) and answer > 0 else None
                restore = pending.get("restore") if isinstance(pending, dict) else None
                slot.restoring = restore if isinstance(restore, str) else None   # none named once it saves
            return
        slot.content, slot.pending, slot.phase, slot.answer_tokens = content_of(doc.get("content")), None, "", None
        slot.restoring = None
        if slot.elsewhere is not None:
            slot.elsewhere = None   # given back by its holder
            self.pool.wake()

    def files_in_use(self) -> set[str]:
        """The saved caches other replicas' requests are using, as far as this replica knows: the file each one
        restores into its slot and the one its save will write. This replica's limits never delete them (the index
        asks, `MetaIndex.in_use_elsewhere`), as they never delete its own requests' (`protect`, `saving`)."""
        return {key for s in self.pool.slots if s.taken and not s.busy
                for key in (s.restoring, s.pending.key if s.pending is not None else None) if key}

    # ---- backends whose folder lpcache cannot see ----

    async def ring_name(self, backend: Backend) -> str | None:
        """The next name of the backend's ring of RING_FILES file names, when lpcache cannot see its slot-save
        folder (another host: lpcache cannot delete there); None when it can. The position is one counter in Redis
        shared by every replica, so the backend holds at most RING_FILES prefix-cache files whoever saved them. A
        name a slot holds, or that a request of any replica is about to restore, is passed over. Raises
        SharedStoreDown when no name can be given: Redis is down (a counter of this replica's own would overwrite
        the files the others name), or every name is in use; nothing is saved there then."""
        folder = backend.config.slot_save_path
        visible: bool = bool(folder) and await asyncio.to_thread(os.path.isdir, folder or "")
        if visible:
            return None
        if self.map.down:
            raise SharedStoreDown("Redis is unreachable: the next name of the backend's ring of files is not known")
        in_use = {key for s in self.pool.slots if s.backend == backend.index
                  for key in (s.content.key if s.content else None, s.pending.key if s.pending else None,
                              s.restoring) if key}
        for _ in range(self.ring_files):
            try:
                async with self._bounded():
                    position = int(await self.client.incr(f"{self.prefix}:ring:{backend.url}"))
            except (RedisError, OSError) as e:
                self.stats.redis_errors += 1
                raise SharedStoreDown(f"Redis did not give the next ring file name: {e!r}") from e
            finally:
                self.stats.redis_calls += 1
            name = ring_file(backend.url, position % self.ring_files)
            if name not in in_use and not self.index.protected(name):
                return name
        raise SharedStoreDown(f"every one of the {self.ring_files} ring file names of {backend.url} is in use")

    # ---- the index, sessions, speeds ----


def ring_file(url: str, position: int) -> str:
    """A ring file name: 64 hex digits, like every prefix cache's, so the index, the limits and `reconcile` treat
    it like one."""
    return hashlib.sha256(f"lpcache ring\n{url}\n{position}".encode()).hexdigest()


