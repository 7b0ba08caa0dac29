"""Which files of the caches idle slots hold the index's limits may take, and when a save waits for its slot.

Past META_MAX (or META_MAX_GIB) a save makes room by deleting a file. The file of a cache an idle slot still holds
costs nothing to delete now (the slot serves it), but the slot must write it again before anything replaces it: the
files plus the slots then hold one distinct cache more, for a second write on a later request's way. Whether that
file pays for the write is weighed with the speeds lpcache measures (`beside_pays`): on a CPU it does by far, and the
slots' own files go first, a cache that could only make room so waiting unsaved in its slot (`save_later`); where a
prefill is about as quick as the disk (a GPU) it does not, and the slots' own files go last, each cache saved after
its answer, or let go when its slot is needed if the slots' own files fill the whole limit (`crowds_slots`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from lpcache.backends.backend import Backend
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content
from lpcache.cache.index import MetaIndex
from lpcache.cache.prefix import Prompt
from lpcache.cache.speeds import SpeedBook
from lpcache.flow.saving import Saver, resavable


class SlotFiles:
    def __init__(self, backends: Sequence[Backend], pool: SlotPool, index: MetaIndex, speeds: SpeedBook,
                 saver: Saver, enabled: Callable[[Backend, str], bool]) -> None:
        self.backends = list(backends)
        self.pool = pool
        self.index = index
        self.speeds = speeds
        self.saver = saver
        self.enabled = enabled   # save and restore for this backend and model (`SlotFiller.enabled`)
        index.held = self.held_keys
        index.in_slots = self.slot_keys
        saver.save_later = self.save_later

    def held_keys(self) -> list[str]:
        """The prefix caches whose files can go first when the index's limits bite, because an idle slot holds
        them, or a cache that continues them, and saves it before anything replaces it (`prepare`): first the files
        a slot's cache holds all of but a short end (with SAVE_POLICY=evict, its conversation's earlier turn,
        restored into it: an unsaved cache is saved before it is replaced anyway, so they go for nothing), then the
        slots' own files (saved again then), both only where one more file beside the slots pays for that second
        write (`beside_pays`)."""
        covered, own = self._held()
        cheap = {key for key, pays in own if not pays}
        return [k for k in covered if k not in cheap] + [key for key, pays in own if pays]

    def slot_keys(self) -> list[str]:
        """The idle slots' own files: the replacement order takes any other file before them (deleting one means
        writing it again before its slot is replaced)."""
        return [key for key, _ in self._held(covered=False)[1]]

    def _held(self, covered: bool = True) -> tuple[list[str], list[tuple[str, bool]]]:
        """(files a slot's cache holds all of but a short end, the slots' own files with `beside_pays`), of the idle
        slots that save their cache before anything replaces it. None with REDIS_URL: another replica replaces a
        slot without saving what this one left there (it does not know its prompt); nor at shutdown: a slot saved
        then is never replaced."""
        within: list[str] = []
        own: list[tuple[str, bool]] = []
        if self.pool.claims is not None or self.saver.stopping:
            return within, own
        for s in self.pool.slots:
            content = s.content
            backend = self.backends[s.backend]
            if s.busy or content is None or not resavable(content) or not self.enabled(backend, content.model):
                continue
            if content.saved:
                own.append((content.key, self.beside_pays(backend, content)))
            if covered:
                within += [k for k in self.index.covered(content.fingerprint, content.chain) if k != content.key]
        return within, own

    def beside_pays(self, backend: Backend, content: Content) -> bool:
        """Whether one more file beside the slots' caches is worth a second write of a slot's cache. When the limits
        bite, a save can make room by deleting the file of a cache an idle slot holds (the slot still serves it, and
        the files then hold one more distinct cache), at the price of writing it again, on the way of the request
        that replaces that slot; or by deleting the file the replacement order names, at the price of the prefill
        that file would spare if its conversation came back (`Worth.spares_ms`: the need rate, the RAM's misses,
        the prefill less the restore). Where a prefill costs seconds (a CPU) the file is worth far more than a
        write; where it is as quick as the disk (a GPU, a stand-in) the second write is the only cost left. Unknown
        speeds: the file is kept, as before they were weighed."""
        tokens = content.tokens
        if not tokens:
            return True
        speeds = self.speeds.of(backend.index, RouterModels.served(backend, content.model))
        spared = self.saver.worth.spares_ms(speeds, tokens, backend.ram.miss_rate(time.monotonic()))
        save = speeds.save.ms_per_token
        if spared is None or save is None:
            return True
        return spared > save * tokens + (speeds.wait_ms or 0.0)   # (the save's /slots call waits too)

    def save_later(self, backend: Backend, content: Content) -> bool:
        """Whether a cache just computed (SAVE_POLICY=eager), or idle (SAVE_IDLE_SECONDS), stays unsaved in its slot
        until the slot is needed: META_MAX is reached and no file can go but the file of a cache an idle slot holds
        (its own, once its slot is idle again, or another's), which that slot would save again before anything
        replaces it (`prepare`). Two writes would keep the caches one write keeps later, when the slot is needed and
        what goes is chosen by the replacement order. Files that can go instead: those a later turn moved on from,
        or that a slot's cache holds all of but a short end; and, where a file beside the slots is not worth a
        second write (`beside_pays`), any file no idle slot holds (`crowds_slots`)."""
        if content.prompt is None or self.pool.claims is not None or self.saver.stopping:
            return False
        return self._room(backend, content, content.prompt, lambda: self.beside_pays(backend, content))

    def crowds_slots(self, backend: Backend, content: Content) -> bool:
        """Where a file beside the slots is not worth a second write (`beside_pays`): whether saving this cache now
        could make room only by deleting the file of a cache an idle slot holds (the idle slots' own files take the
        whole of META_MAX or META_MAX_GIB). Such a file would cost that slot a second write, for a file worth less
        than one: the cache is let go instead of saved when its slot is needed (`prepare`)."""
        if content.prompt is None or content.session is not None or self.pool.claims is not None \
                or self.saver.stopping or self.beside_pays(backend, content):
            return False
        return self._room(backend, content, content.prompt, lambda: False)

    def _room(self, backend: Backend, content: Content, prompt: Prompt, pays: Callable[[], bool]) -> bool:
        """Whether saving `content` now could make room only by deleting an idle slot's own file: more files must
        go than a later turn moved on from or a slot's cache holds, and, where a file beside the slots does not pay
        (`pays()` false), than any file no idle slot holds either (counted in files: with META_MAX_GIB,
        `excess_after` counts a file that does not fit as one more)."""
        excess = self.index.excess_after(prompt, content.key, backend.url, backend.config.slot_save_path,
                                         content.fingerprint, content.tokens)
        if excess <= 0:
            return False
        covered, own = self._held()
        in_use = self.index.files_in_use()
        free = {k for k in covered if k in self.index and k not in in_use}
        if excess <= len(free) or pays():
            return excess > len(free)
        kept_back = {k for k in (free | in_use | {key for key, _ in own}) if k in self.index}
        return excess > len(free) + len(self.index) - len(kept_back)
