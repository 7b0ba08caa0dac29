"""When and how a slot's cache is written to disk: after a big request (SAVE_POLICY=eager), before the slot is
given to another cache, after SAVE_IDLE_SECONDS without a request, before a router unloads the model, and at
shutdown; and what is recorded of it (meta file, session entry).

A save only ever records what the slot really holds: a request whose prompt was not read to its end (the client
left during the prefill) leaves a partial cache, which is neither saved nor allowed to supersede the conversation's
previous, complete file. Saves are retried only when a retry can succeed (the connection, a timeout, a 5xx other
than 501), while the slot is held; a refusal (400, 401, 403, 404) is not retried. A 501 (the server has no
--slot-save-path) turns saving and restoring off for that backend, with one log line, until it is seen down and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lpcache.backends import swap
from lpcache.backends.backend import Backend
from lpcache.backends.llama import SlotAction
from lpcache.backends.placement import Choice
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import Lease, SlotPool
from lpcache.backends.slot_truth import trusted
from lpcache.backends.slots import Content, Slot
from lpcache.cache.index import MetaIndex
from lpcache.cache.meta_files import prefix_file
from lpcache.cache.prefix import Prompt
from lpcache.cache.server_cache import RAM_BET_SECONDS, ServerCaches
from lpcache.cache.sessions import SessionBook, route_name
from lpcache.cache.speeds import SpeedBook, Speeds
from lpcache.cache.worth import Seen, Worth
from lpcache.config import Settings
from lpcache.errors import SharedStoreDown
from lpcache.flow.record import RequestRecord, now_ns

log = logging.getLogger("lpcache.saving")


def resavable(content: Content) -> bool:
    """A prefix cache worth keeping whose prompt is known: it can be saved again under its name."""
    return content.keep and content.session is None and content.prompt is not None


@dataclass
class BackgroundSaves:
    """Saves outside any request (idle, shutdown, a model about to be unloaded): they have no request record."""

    saves_ok: int = 0
    saves_failed: int = 0
    bytes: int = 0


def retryable(result: SlotAction) -> bool:
    """A save that failed for a reason that may pass: no answer, a timeout, a server error (not 501: the server
    has no --slot-save-path, and never will until it restarts). A refusal (400 a router's, 401/403 the key, 404
    the slot) will be the same next time."""
    return not result.ok and (result.status == 0 or (result.status >= 500 and result.status != 501))


def may_have_written(result: SlotAction) -> bool:
    """A failed save that may have left a file under its name: one of other content (the slot held something else
    than believed, `save_held`) or a partial one (no answer, a server error). A refusal wrote nothing."""
    return result.status == 200 or retryable(result)


def cache_file(backend: Backend, prompt: Prompt) -> str:
    """The name `prompt`'s prefix cache is saved under on `backend` (`prefix_file`: its key and the model's
    identity). What a request announces it will leave in its slot, so no replica's limits delete that name while
    llama-server writes it."""
    fingerprint = backend.identity(route_name(prompt.model))
    return prefix_file(prompt.key, fingerprint) if fingerprint else prompt.key


def slot_files_off(backend: Backend, result: SlotAction) -> None:
    """A slot call answered 501: the server has no --slot-save-path; stop asking it (logged once)."""
    if result.status == 501 and not backend.saves_off:
        backend.saves_off = True
        log.warning("slot_saving_off url=%s: the server answered 501 to a slot call (no --slot-save-path); lpcache "
                    "stops saving and restoring there until it restarts", backend.url)


class Saver:
    def __init__(self, settings: Settings, backends: Sequence[Backend], pool: SlotPool, index: MetaIndex,
                 sessions: SessionBook, speeds: SpeedBook, folders: Sequence[swap.Folders],
                 enabled: Callable[[Backend, str], bool], notify: Callable[[RequestRecord], None],
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.settings = settings
        self.backends = list(backends)
        self.pool = pool
        self.index = index
        self.sessions = sessions
        self.speeds = speeds
        self.folders = list(folders)
        self.enabled = enabled
        self.notify = notify
        self.spawn = spawn
        self.idle_saves: dict[Slot, asyncio.Task[None]] = {}
        self.background = BackgroundSaves()
        self.server_caches = ServerCaches()
        # With REDIS_URL: the next name of a backend's ring of file names, for a backend whose slot-save folder
        # lpcache cannot see (`fleet.replica.Fleet.ring_name`); None: the prompt's own name; SharedStoreDown: not now.
        self.ring: Callable[[Backend], Awaitable[str | None]] | None = None
        # Whether a cache worth keeping stays unsaved in its slot for now (`slot_fill.SlotFiller.save_later`).
        self.save_later: Callable[[Backend, Content], bool] = lambda backend, content: False
        self.stopping = False   # the shutdown's saves have begun (`save_all`)
        # told of each request's end, once its save is decided (`flow.unpinned`: enough with no file work, and the
        # backend's requests go unpinned)
        self.observe: Callable[[Backend, RequestRecord], None] = lambda backend, record: None
        # BIG_THRESHOLD_WORDS=auto's decisions, and what came back of the prompts seen (under any setting)
        self.worth = Worth(settings.big_threshold_words is None, settings.big_threshold_words, settings.meta_max)
        self._verdicts: dict[tuple[int, str], bool] = {}
        self._left_to_ram: set[int] = set()   # backends whose `save_left_to_ram` line was logged

    async def file_name(self, backend: Backend, content: Content) -> Content:
        """The name a prefix cache is saved under: its own, or on a backend whose folder lpcache cannot see (and
        so cannot prune), the next of that backend's ring of RING_FILES names, whose previous entry is dropped:
        the save overwrites its file. SharedStoreDown when the ring has no name to give (Redis down): no save."""
        if self.ring is None or content.session is not None:
            return content
        name = await self.ring(backend)
        if name is None or name == content.key:
            return content
        self.index.overwritten(name)
        return replace(content, key=name)

    # ---- after a request ----

    def content_after(self, backend: Backend, prompt: Prompt, big: bool, record: RequestRecord,
                      want: Content | None, prefilled: bool, held_blocks: int) -> Content | None:
        """What the slot holds once the request is over. When the prompt was not read to its end, only the part
        the slot held before is known (and nothing is worth saving)."""
        fingerprint = backend.identity(route_name(prompt.model))
        if not prefilled:
            if held_blocks <= 0:
                return None
            key = want.key if want is not None else prompt.key
            return Content(key, prompt.exact[:held_blocks], model=prompt.model, fingerprint=fingerprint)
        tokens = None
        if record.prompt_tokens is not None and record.completion_tokens is not None:
            tokens = record.prompt_tokens + max(record.completion_tokens - 1, 0)
        if want is not None:
            return replace(want, chain=prompt.exact, tokens=tokens, saved=False)
        return Content(cache_file(backend, prompt), prompt.exact, keep=big, prompt=prompt, model=prompt.model,
                       tokens=tokens, fingerprint=fingerprint)

    def learn(self, backend: Backend, prompt: Prompt, record: RequestRecord) -> None:
        speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
        if record.prefill_ms is not None and record.prompt_n:
            speeds.prefill.add(record.prefill_ms, record.prompt_n)
        if record.gen_ms is not None and record.completion_tokens:
            speeds.generate.add(record.gen_ms, record.completion_tokens)
        speeds.learn_chars(prompt.chars, record.prompt_tokens)
        self.speeds.learnt(backend.index, RouterModels.served(backend, prompt.model))

    async def after(self, lease: Lease, backend: Backend, prompt: Prompt, big: bool, record: RequestRecord,
                    want: Content | None, prefilled: bool, held_blocks: int) -> None:
        """After the client has its answer: save a big prompt's cache (SAVE_POLICY=eager), record it, give the
        slot back, tell the observers. Runs even when the client left mid-stream: the prompt's cache is still worth
        keeping. With SAVE_POLICY=evict the cache stays unsaved in the slot until something needs the slot."""
        choice = lease.choice
        content: Content | None = None
        try:
            self.learn(backend, prompt, record)
            if not prefilled:
                # The client left before the first token: the server notices only between two batches of the
                # prompt, so wait until it has let go of the slot (a request pinned to a busy slot misbehaves),
                # then ask whether it got past the prompt after all.
                model = RouterModels.slot_model(backend, prompt.model)
                await swap.wait_idle(backend.client, choice.slot.id, model)
                prefilled = bool(await swap.decoded(backend.client, choice.slot.id, model))
            previous = choice.slot.content
            if previous is not None and not record.restored and held_blocks and previous.key in self.index:
                self.index.note_use(previous.key)   # continued in the slot that holds it: a use of its file
            content = self.content_after(backend, prompt, big, record, want, prefilled, held_blocks)
            if content is not None and prefilled:
                self.server_caches.held(backend.index, content.chain)
                big, content = self.weigh(backend, prompt, big, record, content, held_blocks, want is not None)
            eager = (content is not None and content.keep and big and self.settings.save_policy == "eager"
                     and self.enabled(backend, prompt.model))
            if eager and want is None and content is not None and self.save_later(backend, content):
                log.info("save_deferred key=%s slot=%s: META_MAX is reached and only the file of a cache an idle "
                         "slot holds could go (saved again when that slot is needed); this one is saved then instead",
                         content.key[:16], choice.slot.name)
            elif eager and content is not None and self.pool.ours(choice.slot):
                choice.slot.phase = "save"
                if self.pool.claims is not None:
                    self.pool.claims.saving(choice.slot)
                save_s = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model)).save.seconds(
                    content.tokens or 0)
                choice.slot.free_at = None if save_s is None else time.monotonic() + save_s
                content = await (self.save_session(choice, backend, content, record) if want is not None
                                 else self.save(choice, backend, prompt, content, record))
        except Exception:  # never leave the slot locked
            log.exception("save_crashed key=%s", prompt.key[:16])
            content = None
        finally:   # a cancellation (shutdown) included
            lease.give_back(content)
            self.schedule_idle_save(choice.slot, backend)
            if self.index.over():   # a restore's file may now be held by its slot: the limits hold again
                self.spawn(self.index.enforce())
            self.observe(backend, record)
            self.notify(record)

    def weigh(self, backend: Backend, prompt: Prompt, big: bool, record: RequestRecord, content: Content,
              held_blocks: int, session: bool) -> tuple[bool, Content]:
        """What the request's cache is worth: under BIG_THRESHOLD_WORDS=auto, whether a file pays (`worth`; the
        cache is kept, and saved, only then); under any setting, whether it continued a prompt seen earlier (the
        need rate, and the prefill a file would have spared: `Worth.came_back`). Returns (big, content)."""
        worth = self.worth
        served = RouterModels.served(backend, prompt.model)
        speeds = self.speeds.of(backend.index, served)
        model = content.fingerprint or prompt.model
        now = time.monotonic()
        earlier = worth.watch.continued(model, prompt.exact, now)
        if earlier is not None:
            held = not record.restored and held_blocks >= earlier.depth
            missed = worth.came_back(earlier, held, bool(record.restored), record.prompt_tokens, record.cache_n,
                                     session or earlier.key in self.index, speeds)
            if missed is not None:
                record.missed_kind, record.missed_tokens, record.missed_seconds = missed
        why = ""
        if worth.auto:
            ram_miss = backend.ram.miss_rate(now)
            keeps = not session and self.ram_keeps(backend, content.tokens, speeds, now)
            big, decision = worth.decide(speeds, content.tokens, record.prefill_ms, record.prompt_n, ram_miss, keeps)
            record.big, record.save_decision = big, decision
            content = replace(content, keep=big)
            why = "" if big else "not_worth"
            if decision == "left_to_ram" and backend.index not in self._left_to_ram:
                self._left_to_ram.add(backend.index)
                log.info("save_left_to_ram backend=%s tokens=%s: a cache worth a file, whose miss would cost at most "
                         "%.0f s of prefill, is left to the server's RAM prompt cache while requests wait for a slot "
                         "(a save would make them wait for the server's batch under way; shown once)",
                         backend.url, content.tokens, RAM_BET_SECONDS)
            elif decision not in ("probe", "left_to_ram") and self._verdicts.get((backend.index, served)) != big:
                self._verdicts[(backend.index, served)] = big
                log.info("save_verdict backend=%s model=%s worth=%s tokens=%s %s: caches like this one are %s",
                         backend.url, served, str(big).lower(), content.tokens, worth.describe(speeds, ram_miss),
                         "saved (a file spares more prefill than it costs here)" if big else
                         "not saved (a file would not spare enough prefill here to pay for its writing)")
        elif not big:
            why = "threshold"
        if content.tokens:
            worth.note(model, prompt.exact, Seen(len(prompt.exact), content.tokens,
                                                 record.prompt_tokens or content.tokens, prompt.n_words,
                                                 content.key, why, now))
        return big, content

    def ram_keeps(self, backend: Backend, tokens: int | None, speeds: Speeds, now: float) -> bool:
        """Whether a prefix cache of `tokens` is better left to the server's RAM prompt cache than saved now: the
        start-up check found one (`backends.ram_check`), it has missed nothing lately, recomputing the cache would
        take at most RAM_BET_SECONDS, and requests wait for a slot. A save's `/slots` call waits for the server's
        batch under way, another slot's prefill (seconds on a CPU), and holds the slot meanwhile, so the request
        next in line waits for that batch and then for the next; the server alone would have started it in the
        batch after. A production chat trace at the default RAM (docs/benchmarks.md, 2026-12-07): 59 saves, 0
        restores, one save of 186 tokens waiting 11.6 s, the time to first token 5 % over the server alone's. When
        the slot is taken, the server copies the cache to its RAM. Only caches whose miss is that cheap: many are
        left unsaved during a busy spell and a RAM smaller than they are together drops the oldest, with no miss
        seen until they come back; and only with one backend and no REDIS_URL, where the return can only come to
        this server (elsewhere a file would serve it on another)."""
        ram = backend.ram
        if len(self.folders) != 1 or self.settings.redis_url or not ram.present or not tokens:
            return False
        if not self.pool.waiting or not all(ram.recent(now)):
            return False
        prefill_s = speeds.prefill.seconds(tokens)
        return prefill_s is not None and prefill_s <= RAM_BET_SECONDS

    async def save_session(self, choice: Choice, backend: Backend, content: Content,
                           record: RequestRecord) -> Content:
        """Eager: write the session's cache to its file now (no retries: the next swap saves it again)."""
        result, _ = await swap.save(backend.client, choice.slot.id, content, self.folders[backend.index],
                                    RouterModels.slot_model(backend, content.model))
        slot_files_off(backend, result)
        self.record_save(backend, content, result, record)
        if not result.ok:
            record.reason = record.reason or "save_failed"
            return content
        info = self.sessions.get(content.key)
        if info is not None:
            self.sessions.saved(info, backend.index, record.save_bytes, content.chain,
                                result.count("n_saved") or content.tokens)
        return replace(content, saved=True)

    async def save(self, choice: Choice, backend: Backend, prompt: Prompt, content: Content,
                   record: RequestRecord) -> Content:
        """Write a prefix cache under its file name, then its meta file (in the background: the slot is free once
        the server has saved it). Retried SAVE_RETRIES times when a retry can succeed."""
        slot = choice.slot
        attempts = 1 + self.settings.save_retries
        model = RouterModels.slot_model(backend, prompt.model)
        result: SlotAction | None = None
        try:
            content = await self.file_name(backend, content)
        except SharedStoreDown as e:
            log.warning("slot_save_skipped slot=%s: %s", slot.name, e)
            return content
        if slot.pending is not None and slot.pending.key != content.key:
            slot.pending = replace(slot.pending, key=content.key)   # a ring's name: told to the others as written
        await self.index.saving(content.key, backend.config.slot_save_path)   # reconciled at start if we stop here
        for attempt in range(1, attempts + 1):
            try:
                result, _ = await swap.save(backend.client, slot.id, content, self.folders[backend.index], model)
            except asyncio.CancelledError:
                self.index.unmark(content.key)
                raise
            if result.ok:
                self.record_save(backend, content, result, record)
                log.info("slot_saved key=%s slot=%s n_saved=%s bytes=%s ms=%.1f", content.key[:16], slot.name,
                         result.body.get("n_saved"), result.body.get("n_written"), result.ms)
                self.spawn(self.index.add(prompt, content.key, backend.url, backend.config.slot_save_path,
                                          content.fingerprint, result.count("n_saved"),
                                          result.count("n_written"),
                                          self.file_worth(backend, content.model, result)))
                return replace(content, saved=True)
            log.warning("slot_save_failed key=%s slot=%s attempt=%d/%d status=%s reason=%r", content.key[:16],
                        slot.name, attempt, attempts, result.status, result.error)
            record.step("save", now_ns() - round(result.ms * 1e6), ok=False, file=content.key, attempt=attempt,
                        status=result.status or None, error=result.error[:200])
            slot_files_off(backend, result)
            if attempt < attempts and retryable(result):
                await asyncio.sleep(self.settings.save_retry_delay_ms / 1000.0)
            else:
                break
        record.saved = False
        record.reason = record.reason or "save_failed"
        if result is None or may_have_written(result):   # the server writes in place: a partial file may be left
            await self.index.forget(content.key, backend.config.slot_save_path)
        else:                   # refused: nothing written
            self.index.unsaving(content.key)
        return content

    def file_worth(self, backend: Backend, model: str, result: SlotAction) -> float | None:
        """What a file just saved spares per byte, for the replacement order (`eviction`)."""
        return self.worth.per_byte(self.speeds.of(backend.index, RouterModels.served(backend, model)),
                                   result.count("n_saved"), result.count("n_written"))

    def record_save(self, backend: Backend, content: Content, result: SlotAction, record: RequestRecord) -> None:
        record.saved, record.save_ms, record.save_file = result.ok, result.ms, content.key
        record.step("save", now_ns() - round(result.ms * 1e6), ok=result.ok, file=content.key,
                    tokens=result.count("n_saved"), bytes=result.count("n_written"))
        record.save_bytes = result.count("n_written")
        if result.ok:
            speeds = self.speeds.of(backend.index, RouterModels.served(backend, content.model))
            speeds.save.add(result.work_ms, result.count("n_saved") or 0)
            speeds.learn_wait(result.ms, result.work_ms)
            backend.loadable.saved(content.fingerprint, result.count("n_saved"), result.count("n_written"))

    # ---- what the slot held, saved before it is replaced ----

    async def save_held(self, backend: Backend, slot: Slot, held: Content, record: RequestRecord | None) -> bool:
        """Save the slot's unsaved cache under its own name (it is about to be replaced); False when it failed."""
        model = RouterModels.slot_model(backend, held.model)
        idle, tokens, marked = await self.idle_and_marked(backend, slot, held, model)
        if not idle:
            return False
        if not swap.holds(backend.client, slot.id, held, tokens):
            if marked:
                self.index.unsaving(held.key)
            if slot.content is held:
                slot.content = None
            return False
        try:
            renamed = await self.file_name(backend, held)
        except SharedStoreDown as e:
            log.warning("slot_save_skipped slot=%s: %s", slot.name, e)
            return False
        if renamed is not held:
            slot.content = held = renamed
        if held.session is None and not marked:
            await self.index.saving(held.key, backend.config.slot_save_path)   # reconciled at start if we stop here
        believed = marked and tokens is None   # not asked (`idle_and_marked`): bounded, and checked by its count
        try:
            result, _ = await swap.save(backend.client, slot.id, held, self.folders[backend.index], model,
                                        timeout=self.believed_save_seconds(backend, held) if believed else None)
        except asyncio.CancelledError:
            self.index.unmark(held.key)
            raise
        if result.ok and held.session is None and not swap.holds(backend.client, slot.id, held,
                                                                 result.count("n_saved")):
            # the slot held something else, not this cache: the file is of other content (deleted: `saved_held`)
            result = replace(result, ok=False, body={**result.body, "error": "the slot held other content"})
            if slot.content is held:
                slot.content = None
        self.saved_held(backend, slot, held, result, record)
        return result.ok

    def believed_save_seconds(self, backend: Backend, held: Content) -> float:
        """A save sent on belief waits for the slot like a look at it would (IDLE_WAIT_SECONDS: a slot busy with
        work lpcache did not send is not waited for longer), plus its own writing time, generously; never longer
        than any call to the server (REQUEST_TIMEOUT)."""
        speeds = self.speeds.of(backend.index, RouterModels.served(backend, held.model))
        writing = speeds.save.seconds(held.tokens or 0)
        bound = swap.IDLE_WAIT_SECONDS * (1 if writing is not None else 2) + 4 * (writing or 0.0)
        return min(bound, backend.client.timeout.total or bound)

    async def idle_and_marked(self, backend: Backend, slot: Slot, held: Content,
                              model: str | None) -> tuple[bool, int | None, bool]:
        """Wait until the server says the slot is idle, and what it holds then (`swap.idle_tokens`); a prefix cache
        that keeps its own name (no ring of names) has its save marked (`index.saving`) while the server is first
        asked, rather than after: both are waited for on the way of the request that needs the slot; within the
        trust window (`slot_truth.trusted`) it is not asked at all, and the save's count is checked after it. A slot
        busy at that first look gives the mark back and is waited for as `idle_tokens` waits (polled every
        IDLE_POLL_SECONDS, IDLE_WAIT_SECONDS at most from the first look). Returns (idle, tokens, marked)."""
        client = backend.client
        if held.session is not None or self.ring is not None:
            idle, tokens = await swap.idle_tokens(client, slot.id, model)
            return idle, tokens, False
        if trusted(backend) and held.key not in self.index:
            # What the slot holds is believed without asking (as `slot_truth` does for the choice of a slot): the
            # save's own count (`n_saved`) is checked instead, and a file of other content is deleted (so never
            # over a file an entry names). A slot still finishing lpcache's last answer defers the save on the
            # server until it is idle.
            try:
                await self.index.saving(held.key, backend.config.slot_save_path)
            except BaseException:
                self.index.unsaving(held.key)
                raise
            return True, None, True
        started = time.monotonic()
        mark = asyncio.ensure_future(self.index.saving(held.key, backend.config.slot_save_path))   # see `save`
        try:
            idle, tokens = await swap.idle_tokens(client, slot.id, model, limit=0)
            await mark
        except BaseException:
            mark.cancel()
            self.index.unsaving(held.key)
            raise
        if idle:
            return idle, tokens, True
        self.index.unsaving(held.key)   # marked again once the slot is idle
        await asyncio.sleep(swap.IDLE_POLL_SECONDS)
        idle, tokens = await swap.idle_tokens(client, slot.id, model,
                                              swap.IDLE_WAIT_SECONDS - (time.monotonic() - started))
        return idle, tokens, False

    def saved_held(self, backend: Backend, slot: Slot, held: Content, result: SlotAction,
                   record: RequestRecord | None) -> None:
        """Bookkeeping after the slot's previous cache was saved under its own name: its meta file (a prefix
        cache) or its session entry; a failed save of a prefix cache may have left a partial file."""
        slot_files_off(backend, result)
        n_written = result.count("n_written")
        if record is not None:
            record.swap_saved, record.swap_save_ms, record.swap_save_bytes = result.ok, result.ms, n_written
            record.step("save_previous", now_ns() - round(result.ms * 1e6), ok=result.ok, file=held.key,
                        tokens=result.count("n_saved"), bytes=n_written)
        else:
            b = self.background
            b.saves_ok, b.saves_failed = b.saves_ok + result.ok, b.saves_failed + (not result.ok)
            b.bytes += n_written or 0
        path = backend.config.slot_save_path
        if result.ok:
            backend.loadable.saved(held.fingerprint, result.count("n_saved"), n_written)
            if slot.content is held:
                slot.content = replace(held, saved=True)
            if held.session is not None:
                info = self.sessions.get(held.key)
                if info is not None:
                    self.sessions.saved(info, backend.index, n_written, held.chain,
                                        result.count("n_saved") or held.tokens)
            elif held.prompt is not None:
                self.spawn(self.index.add(held.prompt, held.key, backend.url, path, held.fingerprint,
                                          result.count("n_saved"), n_written,
                                          self.file_worth(backend, held.model, result)))
        elif held.session is None and may_have_written(result):
            self.spawn(self.index.forget(held.key, path))
        elif held.session is None:
            self.index.unsaving(held.key)   # refused (400, 404, 501): nothing written, an older file stands

    # ---- outside requests: idle, shutdown, a router about to unload ----

    def cancel_idle_save(self, slot: Slot) -> None:
        task = self.idle_saves.pop(slot, None)
        if task is not None:
            task.cancel()

    def schedule_idle_save(self, slot: Slot, backend: Backend) -> None:
        """SAVE_IDLE_SECONDS: save the slot's unsaved cache once no request used it for that long."""
        delay = self.settings.save_idle_seconds
        if delay <= 0 or slot.content is None or not slot.content.dirty:
            return
        self.cancel_idle_save(slot)
        self.idle_saves[slot] = asyncio.ensure_future(self._idle_save(slot, backend, delay))

    async def _idle_save(self, slot: Slot, backend: Backend, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.idle_saves.get(slot) is asyncio.current_task():
            del self.idle_saves[slot]
        await self.save_idle_slot(slot, backend, "idle")

    async def save_idle_slot(self, slot: Slot, backend: Backend, why: str, force: bool = False) -> bool:
        """Save an idle slot's unsaved cache under its own name, holding the slot meanwhile (outside a request:
        idle, shutdown, a router about to unload the model). False when there was nothing to do or the slot was
        taken."""
        held = slot.content
        if held is None or not self.unsaved(held) or not self.enabled(backend, held.model):
            return False
        if why == "idle" and held.session is None and self.save_later(backend, held):
            return False   # its file would only take another idle slot's place: saved when its slot is needed
        if not await self.pool.take_idle(slot, force, writes=held):
            return False
        if slot.content is not held:   # its claim told another replica used it meanwhile: not this cache any more
            self.pool.release(slot, True, used=False)
            return False
        try:
            ok = await self.save_held(backend, slot, held, None)
            log.info("background_save why=%s slot=%s file=%s ok=%s", why, slot.name, held.key, str(ok).lower())
            return ok
        finally:
            self.pool.release(slot, True, used=False)

    def unsaved(self, content: Content) -> bool:
        """Worth keeping and not on disk: changed since its last save (SAVE_POLICY=evict, a deferred save, a small
        session request), or a prefix cache whose file the limits deleted while its slot held it."""
        return content.dirty or (resavable(content) and content.key not in self.index)

    async def save_all(self, timeout: float) -> None:
        """At shutdown: save every idle slot whose cache is worth keeping and not on disk (`unsaved`), so a
        restart has them; the limits then keep what the replacement order says, every slot's cache a candidate."""
        self.stopping = True
        for task in list(self.idle_saves.values()):
            task.cancel()
        self.idle_saves.clear()
        jobs = [self.save_idle_slot(slot, self.backends[slot.backend], "shutdown")
                for slot in self.pool.slots if slot.content is not None and self.unsaved(slot.content)]
        if jobs:
            log.info("saving %d unsaved slot cache(s) before stopping", len(jobs))
            await asyncio.wait([asyncio.ensure_future(j) for j in jobs], timeout=timeout)
