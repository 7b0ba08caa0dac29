"""While llama-server's own RAM prompt cache serves every return and lpcache saves nothing, send a backend's requests
unpinned, up to one more per slot than it has slots, and let the server queue them.

Why: llama-server alone keeps the next request in its own queue, already templated and tokenized, and starts it in
the same loop pass that releases a slot, in the same batch as the other slots' work. A pinned request is sent only
once lpcache has its slot back: it reaches the server after the release, waits there for the batch under way (a
long prefill of another slot: seconds), and the slot stands idle meanwhile. Where lpcache saves nothing and the RAM
serves the returns, pinning buys nothing, and that hand-over is all it costs (BIG_THRESHOLD_WORDS=auto, the default
RAM cache holding the working set: docs/benchmarks.md).

How: per backend, five states. `pinned` (lpcache's usual way); `to_unpinned`: once the RAM has served the last
RAM_TRUST prompts left to it and nothing was saved for the last QUIET_REQUESTS requests there, no slot of the
backend is handed out until the pinned requests under way have ended; `unpinned`: each request takes a slot of the
pool as before (the pool's line, classes and fair shares still decide who goes next) but is sent without `id_slot`,
and gives its slot back at its first token, while the server still generates: the next one is then queued inside
the server. `to_pinned`: when a prompt left to the server comes back short (a miss: files would spare something
again), no slot is handed out until every unpinned request has ended, and (`draining`) until the server says its
slots are idle; only then is a request pinned again, every slot's content unknown. The two kinds never overlap on a
backend: llama-server b11434 runs its RAM cache's load on a pinned slot even while that slot computes another
request (`get_available_slot`, "Pinned + busy slot" in the llama-server notes).

Only where nothing else needs a slot pinned: one backend, no REDIS_URL (another replica's pins), not a router,
BIG_THRESHOLD_WORDS=auto, and the backend's caches enabled. No save, restore or idle save is made there meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lpcache.backends import swap
from lpcache.backends.backend import Backend
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content
from lpcache.cache.prefix import Prompt
from lpcache.cache.reuse import REUSE_MIN_TOKENS
from lpcache.cache.server_cache import RAM_HIT_SHARE, RAM_TRUST
from lpcache.cache.speeds import SpeedBook
from lpcache.config import Settings
from lpcache.flow.record import RequestRecord
from lpcache.flow.saving import Saver

log = logging.getLogger("lpcache.unpinned")

QUIET_REQUESTS = 8        # pinned requests in a row with nothing saved before requests go unpinned
DRAIN_IDLE_SECONDS = 30.0  # how long the switch back waits for the server to say its slots are idle

PINNED, TO_UNPINNED, UNPINNED, TO_PINNED, DRAINING = "pinned", "to_unpinned", "unpinned", "to_pinned", "draining"
PINNING_STATES = (PINNED, TO_UNPINNED, UNPINNED, TO_PINNED, DRAINING)
CLOSED = (TO_UNPINNED, TO_PINNED, DRAINING)   # no slot of the backend handed out meanwhile


class UnpinnedMode:
    def __init__(self, settings: Settings, backends: Sequence[Backend], pool: SlotPool, speeds: SpeedBook,
                 saver: Saver, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.backends = list(backends)
        self.pool = pool
        self.speeds = speeds
        self.server_caches = saver.server_caches
        # the deployment lets it happen at all (see the module's docstring)
        self.allowed = settings.big_threshold_words is None and len(self.backends) == 1 and not settings.redis_url
        self.spawn = spawn
        saver.observe = self.observe
        self.state = {b.index: PINNED for b in self.backends}
        self.inflight = {b.index: 0 for b in self.backends}   # unpinned requests sent and not over
        self.quiet = {b.index: 0 for b in self.backends}      # pinned requests in a row with nothing saved
        self.switches = 0
        self.sent = 0                   # requests sent unpinned (metric)
        pool.closed, pool.unpinned, pool.released_hook = self.closed, self.unpinned, self.released

    # ---- what the pool and the tries ask ----

    def closed(self, backend: int) -> bool:
        """No slot of this backend is handed out: it is switching between pinned and unpinned."""
        return self.state.get(backend, PINNED) in CLOSED

    def unpinned(self, backend: int) -> bool:
        """A request holding a slot of this backend goes out without `id_slot`, and lpcache makes no slot action
        there: its slot was handed out while the backend's requests went unpinned (a switch back waits for it)."""
        return self.state.get(backend, PINNED) in (UNPINNED, TO_PINNED)

    def eligible(self, backend: Backend) -> bool:
        return self.allowed and not backend.router and backend.kv_cache and not backend.saves_off

    # ---- one unpinned request ----

    def began(self, backend: int) -> None:
        """A request took a slot of an unpinned backend: it goes out without `id_slot`."""
        self.inflight[backend] += 1
        self.sent += 1

    def ended(self, backend: int) -> None:
        """An unpinned request is over (answered, failed or left): counted once."""
        self.inflight[backend] = max(self.inflight[backend] - 1, 0)
        self._advance(backend)

    def judge(self, backend: Backend, prompt: Prompt, record: RequestRecord) -> None:
        """An unpinned answer: what the server took from its cache (`cache_n`) against what lpcache saw it hold of
        the prompt (in a slot or, once replaced, in its RAM); short of it is a miss, and files pay again."""
        speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
        found = self.server_caches.find(prompt.exact)
        now = time.monotonic()
        if record.cache_n is not None and found is not None and found[0] == backend.index:
            expected = speeds.tokens_of(found[1])
            if expected >= REUSE_MIN_TOKENS:
                hit = record.cache_n >= RAM_HIT_SHARE * expected
                backend.ram.seen(hit, now)
                record.ram_expected = expected
                if not hit:
                    log.info("unpinned_miss url=%s cache_n=%d expected=%.0f: llama-server computed again what it "
                             "held of the prompt", backend.url, record.cache_n, expected)
        if record.cache_n is not None and record.prompt_tokens:
            self.server_caches.held(backend.index, prompt.exact)
        if not all(backend.ram.recent(now)):   # a miss lately, here or seen elsewhere: files may pay again
            self._switch(backend.index, TO_PINNED)

    # ---- pinned requests ----

    def observe(self, backend: Backend, record: RequestRecord) -> None:
        """A pinned request on `backend` is over (after its save, if any): enough quiet ones while the RAM serves,
        and the backend's requests go unpinned."""
        b = backend.index
        if self.state[b] != PINNED or not self.eligible(backend):
            return
        if record.saved or record.swap_saved or record.reason is not None:
            self.quiet[b] = 0   # (a restore of a file saved earlier does not count: the RAM would have served it)
            return
        self.quiet[b] += 1
        recent = backend.ram.recent(time.monotonic())
        if self.quiet[b] >= QUIET_REQUESTS and len(recent) >= RAM_TRUST and all(recent):
            log.info("unpinned_on url=%s: llama-server's RAM prompt cache served the last %d prompts left to it and "
                     "nothing was saved for the last %d requests; requests go unpinned and the server queues them",
                     backend.url, len(recent), self.quiet[b])
            self._switch(b, TO_UNPINNED)

    # ---- the switches ----

    def _switch(self, backend: int, state: str) -> None:
        if self.state[backend] != {TO_PINNED: UNPINNED, TO_UNPINNED: PINNED}[state]:
            return   # already switching, or there
        self.state[backend] = state
        self.quiet[backend] = 0
        self.switches += 1
        self._advance(backend)

    def released(self, backend: int) -> None:
        """A slot of `backend` was given back (the pool's hook): a switch may be complete."""
        if self.closed(backend):
            self._advance(backend)

    def _advance(self, b: int) -> None:
        state = self.state[b]
        if any(s.backend == b and s.busy for s in self.pool.slots):
            return
        if state == TO_UNPINNED:
            for slot in self.pool.slots:
                if slot.backend == b:
                    slot.content = None   # the server chooses the slots from now on
            self.state[b] = UNPINNED
            self.pool.wake()
        elif state == TO_PINNED and self.inflight[b] == 0:
            self.state[b] = DRAINING   # waiting for the server's word; still closed to hand-outs
            self.spawn(self._pinned_again(self.backends[b]))

    async def _pinned_again(self, backend: Backend) -> None:
        """Every unpinned request has ended here; the server may still be letting go of one a client left: wait
        until it says each slot is idle, then pin again. What a slot holds is unknown but for its size: a slot that
        holds something is one the server looks in its RAM for (a pinned empty one skips it), so a return is sent
        there rather than restored from an older file (`placement.choose`)."""
        held: dict[int, int | None] = {}
        try:
            for slot in self.pool.slots:
                if slot.backend == backend.index:
                    _, held[slot.id] = await swap.idle_tokens(backend.client, slot.id, limit=DRAIN_IDLE_SECONDS)
        finally:
            for slot in self.pool.slots:
                if slot.backend == backend.index:
                    tokens = held.get(slot.id)
                    slot.content = Content("", (), tokens=tokens) if tokens else None
            self.state[backend.index] = PINNED
            backend.suspect = True
            log.info("unpinned_off url=%s: requests are pinned again", backend.url)
            self.pool.wake()

    def describe(self) -> dict[str, Any]:
        return {"state": dict(self.state), "inflight": dict(self.inflight), "switches": self.switches,
                "sent": self.sent}
