"""While llama-server's own RAM prompt cache serves every return and lpcache saves nothing, send a backend's requests
unpinned, up to one more per slot than it has slots, and let the server queue them.

Why: llama-server alone keeps the next request in its own queue, already templated and tokenized, and starts it in
the same loop pass that releases a slot, in the same batch as the other slots' work. A pinned request is sent only
once lpcache has its slot back: it reaches the server after the release, waits there for the batch under way (a
long prefill of another slot: seconds), and the slot stands idle meanwhile. Where lpcache saves nothing and the RAM
serves the returns, pinning buys nothing, and that hand-over is all it costs (BIG_THRESHOLD_WORDS=auto, the default
RAM cache holding the working set: docs/benchmarks.md).

How: per backend, five states. `pinned` (lpcache's usual way); `to_unpinned`: once nothing was saved for the last
QUIET_REQUESTS requests there (but what a slot held, saved only because a restore would take it out of the RAM's
reach: `ram_reach.keeps`) and either the RAM has served the last RAM_TRUST prompts left to it, or those requests'
caches were all judged not worth a file (few prompts come back: pinning would spare nothing) on a server whose RAM
cache the check found and that has missed nothing lately (a production chat trace's requests, which seldom come back
within minutes, gave the RAM too few returns to be trusted: pinned throughout, TTFT p50 5 % over the server alone's),
and no pinned request under way has more prefill left than a switch may wait (SWITCH_SECONDS), no slot of the backend
is handed out until the pinned requests under way have ended; `unpinned`: each request takes a slot of the pool as
before (the pool's line, classes and fair shares still decide who goes next) but is sent without `id_slot`, and gives
its slot back at its first token, while the server still generates: the next one is then queued inside the server.
`to_pinned`: when a prompt left to the server comes back short by more than RAM_BET_SECONDS of prefill, or such small
misses add up to more within RAM_RETRY_SECONDS (a miss: files would spare something again; one short chat turn's
entry that another chat's first prompt took from the RAM costs less than pinning does, and the server alone loses it
the same way), no slot is handed out until every unpinned request has ended, and (`draining`) until the server says
its slots are idle; only then is a request pinned again, every slot's content unknown. The same switch is made ahead
of a miss when a saved file holds much more of a prompt than the server's RAM likely does (`pins_for_file`). The two
kinds never overlap on a backend: llama-server b11434 runs its RAM cache's load on a pinned slot even while that slot
computes another request (`get_available_slot`, "Pinned + busy slot" in the llama-server notes).

Only where nothing else needs a slot pinned: one backend, no REDIS_URL (another replica's pins), not a router,
BIG_THRESHOLD_WORDS=auto, and the backend's caches enabled. No save, restore or idle save is made there meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lpcache.backends import swap
from lpcache.backends.backend import Backend
from lpcache.backends.placement import prefill_left
from lpcache.backends.ram_check import copy_to_ram
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content, Slot
from lpcache.cache.meta_files import file_in
from lpcache.cache.prefix import Prompt
from lpcache.cache.reuse import REUSE_MIN_TOKENS
from lpcache.cache.server_cache import RAM_BET_SECONDS, RAM_HIT_SHARE, RAM_RETRY_SECONDS, RAM_TRUST
from lpcache.cache.speeds import SpeedBook
from lpcache.config import Settings
from lpcache.flow.ram_reach import RamReach
from lpcache.flow.record import RequestRecord
from lpcache.flow.saving import Saver

log = logging.getLogger("lpcache.unpinned")

QUIET_REQUESTS = 8         # pinned requests in a row with nothing saved (see `observe`) before requests go unpinned
SWITCH_SECONDS = 5.0       # the longest a switch keeps hand-outs closed waiting for the other kind to end; past it,
                           # it is called off (a long answer under way), and tried again later: the requests it
                           # asks for, twice as many at each call-off
SWITCH_BACKOFF_SECONDS = 60.0   # after a switch back to pinned was called off: unpinned that long at least
IDLE_POLLS = 2             # GET /slots answers in a row saying every slot is idle before requests are pinned again

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
        self.unworthy = {b.index: 0 for b in self.backends}   # ... whose caches auto judged not worth a file
        self.called_off = {b.index: 0 for b in self.backends}   # switches to unpinned called off lately
        self.pinned_after = {b.index: 0.0 for b in self.backends}   # no switch back to pinned before (monotonic)
        self.timers: dict[int, asyncio.TimerHandle] = {}
        self.putting_back: set[int] = set()   # backends whose lost caches are put back before they go unpinned
        self.sent = 0                   # requests sent unpinned (metric)
        self.small_misses: dict[int, deque[tuple[float, float]]] = {}   # (when, prefill lost) not counted yet
        self.missed_at = {b.index: float("-inf") for b in self.backends}   # the last miss seen unpinned
        self.deferred = {b.index: False for b in self.backends}   # a switch to unpinned put off (`_switch_outlasted`)
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
        if self.inflight[backend] <= 0:
            log.error("unpinned_count_wrong url=%s: an unpinned request ended twice", self.backends[backend].url)
        self.inflight[backend] = max(self.inflight[backend] - 1, 0)
        self._advance(backend)

    def generating(self, client: str | None, delta: int) -> None:
        """An unpinned request of `client` gave its slot back at its first token (1), or is over (-1): still its
        client's, for the fair shares (`SlotPool.holding`)."""
        self.pool.generating[client] += delta
        if self.pool.generating[client] <= 0:
            del self.pool.generating[client]

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
                record.ram_expected = expected
                lost = speeds.prefill.seconds(expected - record.cache_n)
                small = not hit and lost is not None and not self._small_misses_add_up(backend.index, lost, now)
                if not small:
                    backend.ram.seen(hit, now, record.cache_n,
                                     speeds.tokens_of(self.server_caches.since(backend.index, prompt.exact)))
                    if not hit:
                        self.missed_at[backend.index] = now
                if not hit:
                    log.info("unpinned_miss url=%s cache_n=%d expected=%.0f lost_s=%s: llama-server computed again "
                             "what it held of the prompt%s", backend.url, record.cache_n, expected,
                             "?" if lost is None else f"{lost:.2f}",
                             "; a small miss (its lost prefill and the other small ones' lately within "
                             "RAM_BET_SECONDS): requests stay unpinned" if small else "")
        if record.cache_n is not None and record.prompt_tokens:
            self.server_caches.held(backend.index, prompt.exact)
        # A miss of the RAM's seen unpinned lately: files may pay again. Only those: a pinned request still under
        # way when requests went unpinned may have missed for a reason of pinning's own (for instance its previous
        # turn, just answered in the other slot, not yet copied to the RAM when its pinned slot looked there), and
        # one such miss pinned a whole ShareGPT run again (the time to first token 19 % over the server alone's,
        # docs/benchmarks.md). (A restart since makes the RAM forget it: `ram.recent`.)
        if now - self.missed_at[backend.index] <= RAM_RETRY_SECONDS and not all(backend.ram.recent(now)) \
                and now >= self.pinned_after[backend.index]:
            self._switch(backend.index, TO_PINNED)

    def _small_misses_add_up(self, backend: int, lost: float, now: float) -> bool:
        """A miss that lost `lost` seconds of prefill while unpinned: whether it and the other small misses of the
        last RAM_RETRY_SECONDS lost more than RAM_BET_SECONDS together (then it counts, and pins again). One short
        turn's entry that another chat's first prompt took from the RAM costs less than pinning every request for
        RAM_RETRY_SECONDS; a RAM that keeps dropping them does not."""
        small = self.small_misses.setdefault(backend, deque())
        small.append((now, lost))
        while small and now - small[0][0] > RAM_RETRY_SECONDS:
            small.popleft()
        if sum(seconds for _, seconds in small) <= RAM_BET_SECONDS:
            return False
        small.clear()
        return True

    def pins_for_file(self, backend: Backend, prompt: Prompt, file_blocks: int) -> bool:
        """A request handed a slot of an unpinned backend, whose prompt a saved file holds `file_blocks` of: when
        that is more than the server's RAM likely holds (the cache was restored over in its slot while requests
        were pinned, and never copied to the RAM), sent unpinned the server would compute the difference again. If
        that prefill beats a switch there and back (a bar, not a bound: hand-outs closed up to SWITCH_SECONDS at
        each of the two switches, on every slot of the backend; the pinned requests between them pay hand-overs),
        requests are pinned again and this one gives its slot back and waits for it, to restore the file (also
        when a switch is under way already); otherwise it goes unpinned (a short turn's miss costs less)."""
        b = backend.index
        state = self.state[b]
        if state not in (UNPINNED, TO_PINNED) or file_blocks <= 0 or time.monotonic() < self.pinned_after[b]:
            return False
        found = self.server_caches.find(prompt.exact)
        ram_blocks = found[1] if found is not None and found[0] == b else 0
        if file_blocks <= ram_blocks:
            return False
        speeds = self.speeds.of(b, RouterModels.served(backend, prompt.model))
        spared = speeds.prefill.seconds(speeds.tokens_of(file_blocks) - speeds.tokens_of(ram_blocks))
        switch = 2 * SWITCH_SECONDS * backend.n_slots
        if spared is None or spared <= switch:
            return False
        if state == TO_PINNED:
            return True
        log.info("pinned_for_file url=%s file_blocks=%d ram_blocks=%d spared_s=%.1f switch_s=%.0f: a saved file "
                 "holds more of the prompt than the server's RAM likely does; requests are pinned again to restore "
                 "it", backend.url, file_blocks, ram_blocks, spared, switch)
        self._switch(b, TO_PINNED)
        return True

    # ---- pinned requests ----

    def observe(self, backend: Backend, record: RequestRecord) -> None:
        """A pinned request on `backend` is over (after its save, if any): enough quiet ones while the RAM serves,
        and the backend's requests go unpinned."""
        b = backend.index
        if self.state[b] != PINNED or not self.eligible(backend):
            return
        # files do not pay here: its cache judged not worth one, and nothing restored for it
        self.unworthy[b] = self.unworthy[b] + 1 if record.save_decision == "not_worth" and not record.restored else 0
        if record.saved or (record.swap_saved and not record.saved_for_ram) or record.reason is not None:
            # (neither a restore of a file saved earlier counts, nor the save of what the slot held before it made
            # only so that the restore does not take that out of the server's RAM reach: unpinned, the RAM would
            # have served the one and kept the other)
            self.quiet[b] = 0
            self.deferred[b] = False   # a switch put off is logged again when next put off
            return
        self.quiet[b] += 1
        recent = backend.ram.recent(time.monotonic())
        mine = [s for s in self.pool.slots if s.backend == b]
        if any(s.content is not None and s.content.dirty for s in mine):
            return   # a cache worth a file, not saved yet (deferred): saved when its slot is next taken, pinned
        quiet = QUIET_REQUESTS << self.called_off[b]
        if self.quiet[b] < quiet or not all(recent):
            return
        if len(recent) >= RAM_TRUST:
            why = (f"llama-server's RAM prompt cache served the last {len(recent)} prompts left to it and nothing "
                   f"worth a file was saved for the last {self.quiet[b]} requests")
        elif self.unworthy[b] >= quiet and backend.ram.present:
            why = (f"the last {self.unworthy[b]} requests' caches were not worth a file (few prompts come back here) "
                   f"and the server has a RAM prompt cache that missed none of the {len(recent)} prompts left to it "
                   "lately")
        else:
            return
        if self._switch_outlasted(backend, mine):
            return
        log.info("unpinned_on url=%s: %s; requests go unpinned and the server queues them", backend.url, why)
        self._switch(b, TO_UNPINNED)

    def _switch_outlasted(self, backend: Backend, mine: list[Slot]) -> bool:
        """Whether a pinned request under way on `backend` still has more than SWITCH_SECONDS of prefill to compute
        (at the learnt speed): a switch now would keep hand-outs closed, its other slots idle, until it is called off,
        and the next try would wait for twice the quiet requests. The switch is tried again when the next pinned
        request ends quiet (a production chat trace: two switches called off so, each after a slot stood idle 5 s).
        A save under way counts too, until its expected end."""
        speeds = self.speeds.of(backend.index, "")
        now = time.monotonic()
        left = max((prefill_left(s, speeds, now) for s in mine), default=0.0)
        outlasted = left > SWITCH_SECONDS
        if outlasted and not self.deferred[backend.index]:
            log.info("unpinned_deferred url=%s prefill_left_s=%.1f: a pinned request under way computes its prompt "
                     "longer than a switch may wait (%.0f s); tried again when a pinned request ends", backend.url,
                     left, SWITCH_SECONDS)
        self.deferred[backend.index] = outlasted
        return outlasted

    # ---- the switches ----

    def _switch(self, backend: int, state: str) -> None:
        if self.state[backend] != {TO_PINNED: UNPINNED, TO_UNPINNED: PINNED}[state]:
            return   # already switching, or there
        self.state[backend] = state
        self.quiet[backend] = self.unworthy[backend] = 0
        self.timers[backend] = asyncio.get_running_loop().call_later(SWITCH_SECONDS, self._call_off, backend, state)
        self._advance(backend)

    def _call_off(self, b: int, state: str) -> None:
        """The switch waited SWITCH_SECONDS for the other kind's requests to end (a long answer): hand-outs open
        again the way they were, and the switch is tried again later."""
        if self.state[b] != state:
            return
        url = self.backends[b].url
        if state == TO_UNPINNED:
            self.state[b] = PINNED
            self.called_off[b] += 1
            log.info("unpinned_called_off url=%s: a pinned request ran on for %.0f s; requests stay pinned (tried "
                     "again after %d quiet requests)", url, SWITCH_SECONDS, QUIET_REQUESTS << self.called_off[b])
        else:
            self._stay_unpinned(b, f"an unpinned request ran on for {SWITCH_SECONDS:.0f} s")
        self.pool.wake()

    def _stay_unpinned(self, b: int, why: str) -> None:
        self.state[b] = UNPINNED
        self.pinned_after[b] = time.monotonic() + SWITCH_BACKOFF_SECONDS
        log.warning("pinned_called_off url=%s: %s; requests stay unpinned, pinned again after a miss seen at least "
                    "%.0f s from now", self.backends[b].url, why, SWITCH_BACKOFF_SECONDS)

    def released(self, backend: int) -> None:
        """A slot of `backend` was given back (the pool's hook): a switch may be complete."""
        if self.closed(backend):
            self._advance(backend)

    def _advance(self, b: int) -> None:
        state = self.state[b]
        if state not in (TO_UNPINNED, TO_PINNED) or any(s.backend == b and s.busy for s in self.pool.slots):
            return
        if state == TO_UNPINNED:
            if b in self.putting_back:
                return
            self._cancel_timer(b)
            lost = self.server_caches.lost(b)
            if lost:
                self.putting_back.add(b)   # still closed to hand-outs meanwhile
                self.spawn(self._put_back(self.backends[b], lost))
            else:
                self._open_unpinned(b)
        elif self.inflight[b] == 0:
            self._cancel_timer(b)
            self.state[b] = DRAINING   # waiting for the server's word; still closed to hand-outs
            self.spawn(self._pinned_again(self.backends[b]))

    def _open_unpinned(self, b: int) -> None:
        for slot in self.pool.slots:
            if slot.backend == b:
                slot.content = None   # the server chooses the slots from now on
        self.state[b], self.called_off[b] = UNPINNED, 0
        self.pool.wake()

    async def _put_back(self, backend: Backend, lost: list[tuple[str, tuple[int, ...]]]) -> None:
        """Before requests go unpinned: the caches a pinned request's restore replaced before the server had copied
        them to its RAM (saved to files first, `ram_reach.keeps`) in the last 10 minutes are restored into the idle
        slots, newest first, one a slot, where the server's RAM gets them (a request that replaces one copies it
        there first; any request that starts copies the idle ones). Unpinned, a return to one of them would
        otherwise compute it all again: a file holds it, the server does not. Each target slot whose cache the
        server has not copied yet is copied first, by a one-token request of a tiny prompt pinned to it
        (`ram_check.copy_to_ram`), once the server says the slot is idle. At most SWITCH_SECONDS with hand-outs
        closed; whatever fails, requests go unpinned all the same (a cache whose file is gone or whose restore
        failed is forgotten)."""
        b = backend.index
        put = 0
        try:
            async with asyncio.timeout(SWITCH_SECONDS):
                slots = sorted((s for s in self.pool.slots if s.backend == b),
                               key=lambda s: (not RamReach.holds(backend, s), s.last_used))
                folder = slots[0].slot_save_path if slots else None
                present: list[tuple[str, tuple[int, ...]]] = []
                for key, chain in lost:
                    if len(present) == len(slots):
                        break
                    if await asyncio.to_thread(file_in, folder, key) is not False:
                        present.append((key, chain))
                    else:
                        self.server_caches.drop(b, key)
                targets = slots[:len(present)]
                for slot in targets:
                    if slot.content is not None and not RamReach.holds(backend, slot):
                        if not await swap.wait_idle(backend.client, slot.id, limit=SWITCH_SECONDS) or \
                                not await copy_to_ram(backend.client, slot.id):
                            return   # never replace a cache the server may not have copied
                for slot, (key, chain) in zip(targets, present, strict=False):
                    result = await swap.restore_file(backend.client, slot.id, key)
                    if result.ok:
                        self.server_caches.found_again(b, key, chain)
                        put += 1
                    else:
                        self.server_caches.drop(b, key)
        except TimeoutError:
            log.warning("ram_put_back_slow url=%s: putting lost caches back took more than %.0f s; requests go "
                        "unpinned without the rest", backend.url, SWITCH_SECONDS)
        except Exception as e:   # never left closed
            log.warning("ram_put_back_failed url=%s: %s", backend.url, e)
        finally:
            self.putting_back.discard(b)
            if put:
                log.info("ram_put_back url=%s files=%d: caches a restore had taken out of the server's RAM reach are "
                         "back in its slots before requests go unpinned", backend.url, put)
            if self.state[b] == TO_UNPINNED:
                self._open_unpinned(b)

    def _cancel_timer(self, b: int) -> None:
        timer = self.timers.pop(b, None)
        if timer is not None:
            timer.cancel()

    async def _pinned_again(self, backend: Backend) -> None:
        """Every unpinned request has ended here, but the server may still hold one whose client left (it lets go
        at its next batch) or have one queued: requests are pinned again only once GET /slots has said IDLE_POLLS
        times in a row that every slot is idle. What a slot holds is unknown but for its size: a slot that holds
        something is one the server looks in its RAM for (a pinned empty one skips it), so a return goes there
        rather than restoring an older file (`placement.choose`). When the server does not say (no /slots, an
        error, still busy after SWITCH_SECONDS), requests stay unpinned, which is always safe."""
        b = backend.index
        held: dict[int, int | None] | None = None
        try:
            held = await swap.all_idle(backend.client, SWITCH_SECONDS, IDLE_POLLS)
        except Exception as e:   # never left closed
            log.warning("unpinned_drain_failed url=%s: %s", backend.url, e)
        finally:
            if self.state[b] == DRAINING:
                if held is None:
                    self._stay_unpinned(b, "llama-server did not say its slots are idle")
                else:
                    for slot in self.pool.slots:
                        if slot.backend == b:
                            tokens = held.get(slot.id)
                            slot.content = Content("", (), tokens=tokens) if tokens else None
                    self.state[b] = PINNED
                    backend.suspect = True
                    log.info("unpinned_off url=%s: requests are pinned again", backend.url)
                self.pool.wake()
