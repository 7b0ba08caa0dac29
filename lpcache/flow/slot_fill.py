"""What goes into a slot before a request is sent.

- The slot: an idle one chosen by `placement.choose` (a resident exact prefix, or a saved cache worth restoring, looked
  up when the slot is handed out), or a busy one worth waiting for, as long as the wait costs less than the prefill
  it spares (the learnt speeds, SLOT_AFFINITY_WAIT at most).
- Then, in session mode, the session swapped in; in prefix mode, the chosen saved cache restored. A candidate is
  protected from deletion from the moment it is chosen until its restore is done; a file that is gone anyway is
  never asked for (the slot keeps its content). A restore that fails leaves the slot as it was when its previous
  content is on disk (restored back), never empty for nothing: an empty pinned slot also misses llama-server's RAM
  cache.
- Before anything replaces what a slot holds, that is saved when it is worth keeping and not on disk yet.
- After the answer, what the server reports (`cache_n`) is checked against what the slot was believed to hold:
  restores judged for `reuse`, false beliefs corrected (`slot_truth`), in `cache_outcome`.
- What the server's own RAM prompt cache likely holds, and when a prompt is left to it: `ram_reach`.

Every slot call goes through `swap`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from lpcache.backends import swap
from lpcache.backends.backend import Backend
from lpcache.backends.llama import SlotAction
from lpcache.backends.placement import (
    RESIDENT_MIN_SHARE,
    Budget,
    Choice,
    WaitPlan,
    Want,
    beside_wait,
    route_of,
    wait_plan,
)
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content, Slot
from lpcache.cache.index import MetaIndex
from lpcache.cache.meta_files import Candidate, MetaEntry
from lpcache.cache.prefix import Prompt, common_prefix
from lpcache.cache.reuse import ReuseWatch
from lpcache.cache.sessions import SessionBook, route_name
from lpcache.cache.speeds import SpeedBook
from lpcache.config import Settings
from lpcache.errors import QueueFull, SlotsBusy
from lpcache.flow import cache_outcome
from lpcache.flow.ram_reach import RamReach
from lpcache.flow.record import RequestRecord, now_ns
from lpcache.flow.saving import Saver, cache_file, slot_files_off
from lpcache.flow.session_seed import SessionSeeds
from lpcache.flow.slot_files import SlotFiles

log = logging.getLogger("lpcache.slot_fill")


class SlotFiller:
    def __init__(self, settings: Settings, backends: Sequence[Backend], pool: SlotPool, index: MetaIndex,
                 sessions: SessionBook, speeds: SpeedBook, reuse: ReuseWatch, routers: RouterModels,
                 saver: Saver) -> None:
        self.settings = settings
        self.backends = list(backends)
        self.pool = pool
        self.index = index
        self.sessions = sessions
        self.speeds = speeds
        self.reuse = reuse
        self.routers = routers
        self.saver = saver
        self.server_caches = saver.server_caches
        self.ram = RamReach(self.backends, speeds, self.server_caches)
        self.seeds = SessionSeeds(sessions, self.backends, saver.folders, index, settings.words_per_block,
                                  settings.lcp_th)
        self.files = SlotFiles(self.backends, pool, index, speeds, saver, self.enabled)

    # ---- what may be cached where ----

    def enabled(self, backend: Backend, model: str) -> bool:
        """Save and restore for this backend and model: its model's identity is known, BACKENDS does not turn it
        off, the server can (it did not answer 501), and its restores are not found useless."""
        return (backend.kv_cache and not backend.saves_off and backend.identity(route_name(model)) is not None
                and self.reuse.enabled(backend.index, RouterModels.served(backend, model)))

    def lookup(self, prompt: Prompt) -> Callable[[], Candidate | None]:
        """The best saved cache for the prompt, found anew each time it is called (when a slot is handed out)."""
        readers = [b for b in self.backends if self.enabled(b, prompt.model)]
        fingerprints = {fp for b in readers if (fp := b.identity(route_name(prompt.model))) is not None}

        def usable(e: MetaEntry) -> bool:
            return any((e.foreign or e.fingerprint == b.identity(route_name(prompt.model)))
                       and e.readable_by(b.url, b.config.slot_save_path) for b in readers)

        def find() -> Candidate | None:
            return self.index.find(prompt, fingerprints, usable, self.settings.lcp_th) if readers else None

        return find

    def pays(self, prompt: Prompt) -> Callable[[Slot, Candidate, int], bool]:
        """Whether restoring a candidate into a slot beats prefilling the blocks it brings beyond the best resident
        slot, at that backend's speeds."""

        def pays(slot: Slot, candidate: Candidate, gained: int) -> bool:
            backend = self.backends[slot.backend]
            speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
            entry = candidate.entry
            file_tokens = entry.n_tokens or round(speeds.tokens_of(len(entry.exact) or candidate.shared))
            if speeds.restore_pays(file_tokens, speeds.tokens_of(gained)):
                return True
            log.info("restore_skipped backend=%s file=%s file_tokens=%d gained_blocks=%d %s: the prefill is faster",
                     backend.url, entry.key[:16], file_tokens, gained,
                     " ".join(f"{k}={v:.3f}" for k, v in speeds.describe().items() if v is not None))
            return False

        return pays

    def budget(self, prompt: Prompt) -> Budget:
        """How long waiting for a busy slot that brings `blocks` more of the prompt may take: the prefill of those
        blocks at the learnt speed (capped by SLOT_AFFINITY_WAIT), and nothing when the slot is expected to stay
        busy longer. Before the speeds are known, only a slot being saved is waited for. `beside`: see
        `beside_wait`."""
        cap = self.settings.slot_affinity_wait

        def budget(slot: Slot | None, blocks: int, beside: bool) -> float:
            if slot is None or cap <= 0 or blocks <= 0:
                return 0.0
            backend = self.backends[slot.backend]
            speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
            benefit = speeds.prefill.seconds(speeds.tokens_of(blocks))
            if beside and slot.phase != "save":
                return min(cap, beside_wait(slot, speeds.tokens_of(len(prompt.exact)), blocks, speeds))
            if benefit is None:
                return cap if slot.phase == "save" else 0.0
            if slot.free_at is not None and slot.free_at - time.monotonic() >= benefit:
                return 0.0
            if slot.free_at is None and slot.phase != "save":
                # its answer's length: its max_tokens when it said, else a short one, at least
                generate = speeds.generate.seconds(min(slot.answer_tokens or 64, 64))
                if generate is None or generate >= benefit:
                    return 0.0
            return min(cap, benefit)

        return budget

    # ---- the slot ----

    async def take_slot(self, prompt: Prompt, record: RequestRecord, allowed: Callable[[Slot], bool] | None = None,
                        want: Content | None = None, answer_tokens: int | None = None) -> Choice:
        session = want.key if want is not None else None
        fresh = self.seeds.starts_anew(want, prompt, self.pool.slots) if want is not None else None
        homes = self.session_homes(want) if fresh is None else frozenset()
        if fresh is not None and want is not None:
            # placed as in prefix mode (`session_seed`), never steered to a RAM another client key's prompt may fill
            seeds = self.seeds.seed_lookup(prompt, want, fresh, self.lookup(prompt))
            asked = Want(prompt, seeds, allowed, session, frozenset(), self.pays(prompt), self.seeds.protect,
                         self.seeds.unprotect, None, self.index.__contains__, seed=True,
                         mine=self.seeds.owned_by(fresh.owner))
        else:
            asked = Want(prompt, self.lookup(prompt) if want is None else (lambda: None), allowed, session, homes,
                         self.pays(prompt), self.index.protect, self.index.unprotect,
                         (lambda best: self.ram.warm(prompt, best)) if want is None else None, self.index.__contains__,
                         file_of=lambda slot: cache_file(self.backends[slot.backend], prompt))
        asked.answer_tokens, asked.ticket, asked.max_wait = answer_tokens, record.ticket, record.max_wait
        planned_for = None if fresh is not None else session

        def plan_again() -> WaitPlan | None:
            if all(self.pool.unpinned(s.backend) for s in self.pool.slots):   # the server chooses (`unpinned`)
                return None
            return wait_plan(self.pool.slots, prompt, asked.lookup(), allowed, planned_for, homes,
                             self.budget(prompt), asked.mine)

        plan = plan_again()
        started = time.perf_counter()
        try:
            choice, planned = await self.pool.take(asked, plan, asked.max_wait, replan=plan_again)
        except (SlotsBusy, QueueFull) as e:
            record.reason = "slot_timeout" if e.code == "all_slots_busy" else str(e.code)
            raise
        waited, record.ticket = time.perf_counter() - started, asked.ticket   # its place kept if it waits again
        record.queue_ms = (record.queue_ms or 0.0) + waited * 1000.0   # every wait of the request for a slot
        self.pool.waited(asked, waited)
        if want is None or fresh is not None:
            choice = await self.after_save_under_way(choice, asked, prompt)
        if fresh is not None:
            choice = replace(choice, seed=True)
        if plan is not None and not planned:
            log.info("own_slot_still_busy key=%s plan_s=%.2f waited_s=%.2f: the busy slot that holds more of the "
                     "prompt was not free within plan_s (what waiting for it could spare), or went to a request ahead "
                     "in line; the request took the first slot to come free (waited_s: both waits)", prompt.key[:16],
                     plan.seconds, time.perf_counter() - started)
        if fresh is None and homes and choice.slot.backend not in homes:
            budget = self.budget(prompt)
            log.info("session_away file=%s slot=%s homes=%s plan=%s waited=%s home_slots=%s speeds=%s: the session's "
                     "newest file is not on this server; its prompt is computed (after an older copy of the file "
                     "where this server's folder has one)", session, choice.slot.name, sorted(homes),
                     None if plan is None else round(plan.seconds, 2), planned,
                     ",".join(f"{s.name}:{'busy' if s.busy else 'elsewhere' if s.taken else 'idle'}/{s.phase or '-'}"
                              f"/budget={budget(s, len(prompt.exact), False):.2f}/answer={s.answer_tokens}"
                              f"/free_in={None if s.free_at is None else round(s.free_at - time.monotonic(), 2)}"
                              for s in self.pool.slots if s.backend in homes),
                     ";".join(f"{h}:" + ",".join(f"{k.split('_')[0]}={v:.2f}" for k, v in self.speeds.of(
                         h, RouterModels.served(self.backends[h], prompt.model)).describe().items() if v is not None)
                              for h in sorted(homes)))
        self.saver.cancel_idle_save(choice.slot)
        choice.slot.pending = want or Content(cache_file(self.backends[choice.slot.backend], prompt), prompt.exact)
        choice.slot.phase, choice.slot.free_at = "prefill", None
        choice.slot.stream = bool(record.stream)
        choice.slot.answer_tokens = answer_tokens
        choice.slot.computing = max(0, len(choice.slot.pending.chain) - choice.uncomputed)
        record.backend, record.slot = self.backends[choice.slot.backend].url, choice.slot.id
        record.restore_skipped = choice.skipped or None
        record.route = ("waited_" if planned else "") + route_of(choice, want)
        if fresh is not None:
            record.seeded = self.seeds.seeded_from(choice, fresh)
            if record.seeded is not None:
                record.route += "_seeded"
        if choice.warm:
            speeds = self.speeds.of(choice.slot.backend, RouterModels.served(self.backends[choice.slot.backend],
                                                                             prompt.model))
            record.ram_expected = speeds.tokens_of(choice.warm_blocks)
        if choice.restore is not None:
            c = choice.restore
            log.info("restore_candidate key=%s shared_blocks=%d of=%d ratio=%.3f exact=%s", c.entry.key[:16],
                     c.shared, len(prompt.exact), c.ratio, str(c.exact).lower())
        return choice

    async def after_save_under_way(self, choice: Choice, asked: Want, prompt: Prompt) -> Choice:
        """A slot whose answer is over and whose cache is being saved (`phase` "save") may hold more of the prompt
        than the chosen slot or file brings: an agent's next session sent the moment the previous answer ended, while
        the one request allowed to wait for that slot waits for it. Its file is on disk in a moment (a save takes a
        fraction of the prefill it spares): wait for that slot's release, at most the prefill of what it brings more
        (SLOT_AFFINITY_WAIT before the speeds are learnt), then choose what to restore into this slot again."""
        cap = self.settings.slot_affinity_wait
        if cap <= 0 or not prompt.exact:
            return choice
        mine = choice.slot
        brought = choice.restore.shared if choice.restore is not None else choice.resident
        least = max(1, math.ceil(RESIDENT_MIN_SHARE * len(prompt.exact)))
        best, more = None, 0
        for other in self.pool.slots:
            held = other.pending or other.content
            if other is mine or not other.busy or other.phase != "save" or held is None or held.session is not None \
                    or other.slot_save_path != mine.slot_save_path or not mine.kv_cache:
                continue
            shared = common_prefix(held.chain, prompt.exact)
            if shared >= least and shared - brought > more:
                best, more = other, shared - brought
        if best is None:
            return choice
        backend = self.backends[mine.backend]
        speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
        spared = speeds.prefill.seconds(speeds.tokens_of(more))
        started = time.perf_counter()
        mine.pending = Content(cache_file(backend, prompt), prompt.exact)   # what other requests see in it meanwhile
        try:
            released = await self.pool.until_released(best, cap if spared is None else min(cap, spared))
        except BaseException:   # cancelled (the client left): the slot goes back as it was
            self.release_choice(choice)
            self.pool.release(mine, True, used=False)
            raise
        log.info("waited_for_save slot=%s saving=%s blocks=%d released=%s ms=%.1f: a slot being saved held more of "
                 "the prompt than this one or its best file", mine.name, best.name, more, str(released).lower(),
                 (time.perf_counter() - started) * 1000.0)
        self.release_choice(choice)
        return asked.choose([mine], self.pool.load())

    def session_homes(self, want: Content | None) -> frozenset[int]:
        """The backends whose slot-save folder has the session's newest file (where it was last saved, or a folder
        shared with that backend). A copy another server saved before it is older: restoring it would compute again
        the turns saved since, so such a server is no home to choose or wait for. When the book knows of no save
        (another replica's, not heard of yet): where the folders have its newest copy (`found_homes`)."""
        info = self.sessions.get(want.key) if want is not None else None
        if info is None or not info.homes:
            return self.seeds.found_homes(want.key) if want is not None else frozenset()
        newest = {info.latest} if info.latest is not None and info.latest < len(self.backends) else info.homes
        paths = {self.backends[i].config.slot_save_path for i in newest} - {None}
        return frozenset(b.index for b in self.backends
                         if b.index in newest or b.config.slot_save_path in paths)

    def release_choice(self, choice: Choice) -> None:
        """The restore ran, or the request gave up its slot before it: its candidate is no longer protected."""
        if choice.restore is not None:
            (self.seeds.unprotect if choice.seed else self.index.unprotect)(choice.restore.entry.key)

    # ---- filling it ----

    async def prepare(self, choice: Choice, backend: Backend, prompt: Prompt, want: Content | None,
                      record: RequestRecord) -> None:
        """Make the slot hold the best cache for the request before it is sent (session mode: swap the session in;
        prefix mode: restore the chosen file), what it holds saved first when it is worth keeping and unsaved."""
        record.saved_for_ram = False   # this try's (a failover's earlier try may have set it)
        try:
            await self.routers.make_room(backend, prompt.model)
            if not self.enabled(backend, prompt.model):
                return
            if not self.pool.ours(choice.slot):
                # the slot's lease lapsed (Redis down or stalled past SLOT_LEASE_MS): another replica may use it
                # now, so nothing is saved from it or restored into it; the prompt is computed
                log.warning("slot_fill_skipped_lease slot=%s: the slot's lease lapsed", choice.slot.name)
                choice.slot.content = None
                return
            if want is not None and not (choice.seed and choice.restore is not None):
                # (a session starting anew seeded from a saved cache, `take_slot`, is restored as in prefix mode)
                if want.fingerprint is not None and backend.identity(route_name(prompt.model)) != want.fingerprint:
                    # this backend runs another model than the one the session's file was named for: never
                    # restore it here, and what the slot will hold is not that file's
                    choice.slot.content = None
                    return
                await self.swap_session(choice, backend, prompt, want, record, seed=choice.seed)
                return
            slot, restoring = choice.slot, choice.restore is not None
            held = slot.content
            if restoring and held is not None and self.ram.keeps(backend, slot, held):
                held = slot.content = replace(held, keep=True)   # the restore would lose it: saved first
                record.saved_for_ram = True
            if held is not None and self.saver.unsaved(held) and (
                    restoring or common_prefix(held.chain, prompt.exact) < len(held.chain)):
                if not record.saved_for_ram and self.files.crowds_slots(backend, held):
                    log.info("save_dropped key=%s slot=%s: its file could only take the place of an idle slot's own "
                             "file, and a file spares less than a write here (beside_pays); the cache is let go",
                             held.key[:16], slot.name)
                else:
                    await self.saver.save_held(backend, slot, held, record)
            if restoring and not self.pool.ours(slot):   # lapsed during the save
                log.warning("restore_skipped_lease slot=%s: the slot's lease lapsed; its prompt is computed",
                            slot.name)
            elif restoring:
                await self.restore(choice, backend, prompt, record)
        finally:
            self.release_choice(choice)
            # after the restore's I/O: the meta entry of what the slot held (`saved_held`, spawned) is in the index
            self.pool.handed_over(choice.slot)

    async def restore(self, choice: Choice, backend: Backend, prompt: Prompt, record: RequestRecord) -> None:
        """Load the chosen saved cache into the slot. A file that is gone is not asked for; a restore that fails
        (the server then clears the slot) gets the slot's previous content back when that is on disk."""
        assert choice.restore is not None
        candidate, slot = choice.restore, choice.slot
        entry = candidate.entry
        seed = self.sessions.get(entry.key)   # another session's file, seeding a new session (`session_seed`)
        present = await asyncio.to_thread(self.index.file_present, entry, slot.slot_save_path)
        if (seed is None and entry.key not in self.index) or present is False:
            self.index.lost += seed is None
            record.restore_lost = True
            self.seeds.outcome(choice.seed, record, False)
            log.warning("restore_lost key=%s slot=%s: the chosen cache's file is gone (%s); the slot keeps what it "
                        "holds", entry.key[:16], slot.name,
                        "no entry" if seed is None and entry.key not in self.index else "no file")
            if seed is None and entry.key in self.index:
                await self.index.discard_if_stale(entry.key)
            return
        previous = slot.content
        self.ram.restored_over(backend, previous, self.ram.holds(backend, slot))
        model = RouterModels.slot_model(backend, prompt.model)
        result = await swap.restore_file(backend.client, slot.id, entry.key, model)
        self.note_restore(backend, prompt.model, result, record)
        log.info("restore_before_chat key=%s slot=%s ok=%s n_restored=%s ms=%.1f%s", entry.key[:16], slot.name,
                 str(result.ok).lower(), result.body.get("n_restored"), result.ms,
                 "" if result.ok else f" reason={result.error!r}")
        record.restore_share = candidate.ratio
        record.restore_exact = candidate.exact
        record.restore_file = entry.key
        if result.ok:
            restored_tokens = record.restored_tokens or 0
            share = candidate.shared / max(len(entry.exact), 1) if candidate.exact else candidate.ratio
            record.restore_expected = min(restored_tokens, entry.n_tokens or restored_tokens) * min(share, 1.0)
            chain = entry.exact if candidate.exact else ()
            slot.content = Content(entry.key, chain, saved=True, keep=True, model=prompt.model,
                                   tokens=result.count("n_restored"), fingerprint=entry.fingerprint,
                                   session=seed.session if seed is not None else None)
            record.cache_hit = candidate.exact
            backend.loadable.restored(entry.fingerprint)   # a refusal before it was no news of the layout
            self.seeds.outcome(choice.seed, record, True)
            if seed is None:
                self.saver.spawn(self.index.touch(entry.key))  # the file timestamp is rewritten off the path
            else:   # a session's file used as a seed: the last of its route the session limits delete
                self.saver.spawn(asyncio.to_thread(self.seeds.used, slot.backend, entry.key))
            return
        slot.content = None
        self.seeds.outcome(choice.seed, record, False)
        gone = seed is None and await self.index.discard_if_stale(entry.key)
        layout = not gone and result.unreadable_file and backend.loadable.refused(entry)   # nor its like
        log.warning("restore_failed key=%s slot=%s status=%s reason=%r: the server cleared the slot%s", entry.key[:16],
                    slot.name, result.status, result.error, "; its KV layout is not offered there" if layout else "")
        if previous is not None and previous.saved and not layout:
            back = await swap.restore_file(backend.client, slot.id, previous.key, model)
            if back.ok:
                slot.content = previous
                log.info("restore_back key=%s slot=%s: the slot holds its previous cache", previous.key[:16], slot.name)
            elif back.unreadable_file and (was := self.index.get(previous.key)) is not None:
                backend.loadable.refused(was)   # a second refusal like it before a save: its layout is not the server's

    def note_restore(self, backend: Backend, model: str, result: SlotAction, record: RequestRecord) -> None:
        """A restore's answer, in the record and (when it worked) in the backend's restore speed."""
        slot_files_off(backend, result)
        record.restored, record.restore_ms = result.ok, result.ms
        record.restore_bytes, record.restored_tokens = result.count("n_read"), result.count("n_restored")
        record.step("restore", now_ns() - round(result.ms * 1e6), ok=result.ok, tokens=record.restored_tokens)
        if result.ok:
            speeds = self.speeds.of(backend.index, RouterModels.served(backend, model))
            speeds.restore.add(result.work_ms, record.restored_tokens or 0)
            speeds.learn_wait(result.ms, result.work_ms)
            backend.ram.restored(speeds.prefill.seconds(record.restored_tokens or 0))

    async def swap_session(self, choice: Choice, backend: Backend, prompt: Prompt, want: Content,
                           record: RequestRecord, seed: bool = False) -> None:
        """Swap the session's file in (what the slot held saved first when it has to be). `seed`: the session
        starts anew in a slot chosen as in prefix mode, which keeps what it holds (its prefix, or nothing better)."""
        slot = choice.slot
        info = self.sessions.get(want.key)
        restore = not seed
        if not seed and info is not None and (slot.content is None or slot.content.key != want.key):
            speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
            found = self.server_caches.find(prompt.exact)
            shares = common_prefix(slot.content.chain, prompt.exact) if slot.content is not None else 0
            if found is not None and (found[0] != backend.index or found[1] < shares + 2):
                found = None   # not this server's, or no more than the slot itself holds (a shared system prompt)
            file_tokens: float | None = None   # what the session's file holds of the prompt, to weigh the RAM with
            if info.saved_chain:
                gained = common_prefix(info.saved_chain, prompt.exact)
                restore = speeds.restore_pays(round(speeds.tokens_of(len(info.saved_chain))),
                                              speeds.tokens_of(gained))
                record.restore_skipped = not restore or None
                if restore and found is not None and found[1] >= gained:
                    file_tokens = speeds.tokens_of(gained)
            elif found is not None and info.saved_tokens:
                # its file holds less than one identity block (a chat's "hi" and its answer), so its chain says
                # nothing, and the server held more of the session since (`found`: a turn left to the RAM). Restored
                # blindly, it threw that turn away; it is weighed by its tokens like any older file
                file_tokens = info.saved_tokens
            elif found is not None and slot.content is not None:
                # no file (none was worth saving): the RAM is the only place the prompt can come from, and what it
                # does is seen for free, misses included (`RamWatch.miss_rate`)
                record.ram_expected = speeds.tokens_of(found[1])
            if file_tokens is not None and found is not None and slot.content is not None and \
                    self.ram.rely(backend, speeds, found[1], probe=True, file_tokens=file_tokens):
                # the server's RAM likely holds the session's prompt: the pinned request finds it there
                restore = False
                record.ram_expected = speeds.tokens_of(found[1])
                record.route = "session_server_ram"
        held = slot.content
        if restore and info is not None and (info.saved_chain or info.homes) and held is not None and \
                held.key != want.key and self.ram.keeps(backend, slot, held):
            slot.content = replace(held, keep=True)   # the restore would lose it: saved first
            record.saved_for_ram = True
        if not self.pool.ours(slot):
            slot.content = None
            return
        marked = slot.content.key if slot.content is not None and slot.content.dirty and \
            slot.content.session is None else None
        if marked is not None:
            await self.saver.index.saving(marked, backend.config.slot_save_path)   # may be saved here

        async def held_saved(so_far: swap.Swap) -> None:
            # right after any save of what the slot held: bookkept before the hand-over wakes those who want it
            if so_far.saved is not None and slot.content is not None:
                self.saver.saved_held(backend, slot, slot.content, so_far.saved, record)
            self.pool.handed_over(slot)
            for other in self.pool.slots:
                if other.filling is not None and other.content is not None and other.content.key == want.key:
                    # the session's last turn is in a slot just handed to another request, which saves it first
                    await other.filling.wait()

        previous, idle_copied = slot.content, self.ram.holds(backend, slot)
        try:
            result = await swap.bring_in(backend.client, slot.id, slot.content, want, self.saver.folders[backend.index],
                                         RouterModels.slot_model(backend, prompt.model), restore=restore, owned=True,
                                         held_saved=held_saved)
        except BaseException:
            if marked is not None:
                self.saver.index.unmark(marked)   # a save may have been sent: its marker stays for `reconcile`
            raise
        if marked is not None and result.saved is None:
            self.saver.index.unsaving(marked)   # no save sent (the slot was busy, or held something else)
        slot.content = result.held
        restored = result.restored
        if restored is not None:
            self.ram.restored_over(backend, previous, idle_copied, saved=result.saved is not None and result.saved.ok)
            self.note_restore(backend, prompt.model, restored, record)
            record.restore_exact = True
            # a copy an earlier turn left in this server's folder, older than the one saved since on another
            # server's: it spares what it holds, and what that is the newest file's chain does not say
            newest = info is not None and bool(info.saved_chain) and backend.index in self.session_homes(want)
            if info is not None and newest and prompt.exact:
                shared = common_prefix(info.saved_chain, prompt.exact)
                record.restore_share = shared / len(prompt.exact)
                record.restore_expected = (record.restored_tokens or 0) * shared / len(info.saved_chain)
            if restored.ok and info is not None:
                info.restores += 1
                if slot.content is not None:
                    slot.content = replace(slot.content, chain=info.saved_chain if newest else (),
                                           tokens=restored.count("n_restored"))
        hit = result.skipped == "resident" or bool(restored is not None and restored.ok)
        record.cache_hit = hit
        if info is not None and hit:
            info.cache_hits += 1

    def judge(self, choice: Choice, backend: Backend, prompt: Prompt, record: RequestRecord) -> None:
        """After the answer: check `cache_n` against what the slot was believed to hold (`cache_outcome`)."""
        cache_outcome.judge(choice, backend, prompt, record, self.index, self.speeds, self.reuse, self.saver)
