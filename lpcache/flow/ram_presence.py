"""Whether each backend keeps a RAM prompt cache, asked when lpcache starts and again after the server restarted
(`backends.ram_check`), so that BIG_THRESHOLD_WORDS=auto does not spend a workload learning it.

Why: the answer decides what auto's files are for. A server started with `--cache-ram 0` keeps nothing once a slot is
reused, so it is never left a return to serve (`RamWatch.present` False: no probe ever costs a prefill). A server with a
RAM cache is relied on from the first return its RAM likely holds until it misses one, not probed after the files have
spared PROBE_PAYBACK prefills: on the default RAM cache, that wait kept requests pinned and restored from files for half
of a ShareGPT run.

How: on an idle slot that holds nothing lpcache would lose (empty, or a cache already on disk), taken from the pool like
an idle save (never ahead of a waiting request), three tiny requests. A backend that is busy or down is asked again
later (RETRY_SECONDS), one that did not answer clearly less and less often; one whose answer is known is not asked again
until its slots show it restarted (`slot_truth`: no slot has run a task since the server started, or their task numbers
went back; a relied-on RAM that misses also stops being relied on), when what lpcache believed of its RAM goes too
(`restarted`). Only under BIG_THRESHOLD_WORDS=auto, and not on a router (a model's instance comes and goes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lpcache.backends.backend import CLOSED, Backend
from lpcache.backends.ram_check import ram_cache_found
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Slot
from lpcache.cache.server_cache import ServerCaches
from lpcache.config import Settings

log = logging.getLogger("lpcache.ram_presence")

RETRY_SECONDS = 30.0   # a backend not asked (busy, down) is asked again after this long; one whose answer was not
                       # clear, after twice as long at each such answer, up to MAX_RETRY_SECONDS
MAX_RETRY_SECONDS = 3600.0


class RamPresence:
    def __init__(self, settings: Settings, backends: Sequence[Backend], pool: SlotPool, server_caches: ServerCaches,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.backends = list(backends)
        self.pool = pool
        self.server_caches = server_caches
        self.spawn = spawn
        self.enabled = settings.big_threshold_words is None
        self.asking: set[int] = set()
        self.next_ask: dict[int, float] = {}   # backend index -> not asked before (monotonic)
        self.unclear: dict[int, int] = {}      # backend index -> answers in a row that said nothing clear

    def due(self) -> None:
        """Ask the backends whose answer is not known, unless one is under way or was tried lately (cheap: called
        as each request ends)."""
        if not self.enabled:
            return
        now = time.monotonic()
        for backend in self.backends:
            b = backend.index
            if (backend.ram.present is None and b not in self.asking and now >= self.next_ask.get(b, 0.0)
                    and not backend.router and backend.kv_cache and backend.slots_known
                    and backend.breaker.state == CLOSED):
                self.asking.add(b)
                self.spawn(self._ask(backend))

    def restarted(self, backend: Backend) -> None:
        """The server's slots show it restarted: its RAM holds nothing lpcache sent before, and is asked about again."""
        if backend.ram.present is not None or backend.ram.outcomes:
            log.info("ram_forgotten url=%s: llama-server restarted; what its RAM prompt cache held is gone",
                     backend.url)
        backend.ram.forget()
        self.server_caches.forget(backend.index)
        self.next_ask.pop(backend.index, None)
        self.unclear.pop(backend.index, None)
        self.due()

    async def _ask(self, backend: Backend) -> None:
        b = backend.index
        self.next_ask[b] = time.monotonic() + RETRY_SECONDS
        generation = backend.ram.generation
        try:
            slot = self._spare_slot(backend)
            if slot is None or not await self.pool.take_idle(slot):
                return
            try:
                found = await ram_cache_found(backend.client, slot.id)
            finally:
                self.pool.release(slot, None, used=False)   # it may hold the check's prompt now
            if found is not None:
                self.unclear.pop(b, None)
                backend.ram.answered(found, generation)
            else:   # an error, or not llama-server's answer: asked again, less and less often
                self.unclear[b] = self.unclear.get(b, 0) + 1
                self.next_ask[b] = time.monotonic() + min(RETRY_SECONDS * 2 ** self.unclear[b], MAX_RETRY_SECONDS)
        except Exception:   # never a crash for a check: what it would have said is learnt from the returns
            log.exception("ram_check_crashed url=%s", backend.url)
        finally:
            self.asking.discard(b)

    def _spare_slot(self, backend: Backend) -> Slot | None:
        """An idle slot of the backend whose cache the check may replace: an empty one first, else one whose cache
        is on disk already (or was not worth keeping)."""
        spare = [s for s in self.pool.slots if s.backend == backend.index and not s.taken
                 and (s.content is None or not s.content.dirty)]
        return min(spare, key=lambda s: (s.content is not None, s.last_used, s.id), default=None)
