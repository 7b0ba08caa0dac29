"""What llama-server's own RAM prompt cache likely holds of a prompt, and whether lpcache leaves a prompt to it.

The server copies a slot's cache to its RAM when a request replaces it, and every idle slot whenever a request starts
(`--cache-idle-slots`); a restore replaces a slot's cache without copying it. So what a slot held is in the RAM
unless a restore replaced it first (`holds`, `restored_over`, `keeps`), and where the RAM likely holds a prompt
(`server_cache.ServerCaches`) its expected cost, a miss's prefill weighed by how often it misses (`RamWatch`), is
set against a restore's (`warm`, `rely`). Used by `slot_fill` to choose a slot and what to put in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from lpcache.backends.backend import Backend
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slots import Content, Slot
from lpcache.cache.meta_files import Candidate
from lpcache.cache.prefix import Prompt
from lpcache.cache.server_cache import ServerCaches
from lpcache.cache.speeds import SpeedBook, Speeds

log = logging.getLogger("lpcache.slot_fill")


class RamReach:
    def __init__(self, backends: Sequence[Backend], speeds: SpeedBook, server_caches: ServerCaches) -> None:
        self.backends = list(backends)
        self.speeds = speeds
        self.server_caches = server_caches

    def warm(self, prompt: Prompt, best: Candidate | None = None) -> tuple[int, int, bool] | None:
        """The server whose RAM likely holds the longest prefix of the prompt (`server_cache`), how much, whether it
        is relied on over a restore of the `best` file (`rely`, with the prefill of what that file lacks)."""
        found = self.server_caches.find(prompt.exact)
        if found is None or self.backends[found[0]].ram.present is False:
            return None   # (a server that said it has no RAM cache holds nothing once a slot is reused)
        backend = self.backends[found[0]]
        speeds = self.speeds.of(backend.index, RouterModels.served(backend, prompt.model))
        file_tokens = speeds.tokens_of(best.shared) if best is not None and best.shared < found[1] else None
        return found[0], found[1], self.rely(backend, speeds, found[1], file_tokens=file_tokens)

    def rely(self, backend: Backend, speeds: Speeds, blocks: int, probe: bool = False,
             file_tokens: float | None = None) -> bool:
        """Whether to leave `blocks` of a prompt to the server's RAM prompt cache rather than restore them from a
        file (`server_cache.RamWatch`); with `probe`, also to find out whether that RAM serves (`RamWatch.probe`:
        the caller is about to restore, and its slot holds something, so the server will look in its RAM).
        `file_tokens`: the file holds only that many of their tokens (an older turn of a session whose last one was
        left to the RAM): the restore's side also prefills the rest."""
        tokens = speeds.tokens_of(blocks)
        prefill = speeds.prefill.seconds(tokens)
        held = tokens if file_tokens is None else min(file_tokens, tokens)
        rest = speeds.prefill.seconds(tokens - held) if held < tokens else 0.0
        restore = speeds.restore.seconds(held)
        if restore is not None and rest is not None:
            restore += (speeds.wait_ms or 0.0) / 1000.0 + rest
        else:
            restore = None   # one side unknown: nothing to weigh
        now = time.monotonic()
        if backend.ram.rely(prefill, restore, now, tokens):
            return True
        if restore is None and rest and backend.ram.rely(prefill, rest, now, tokens):
            return True   # no restore measured yet, but the prefill of what the file lacks alone costs more
        if probe and backend.ram.probe(prefill, now, tokens):
            log.info("ram_probe url=%s blocks=%d tokens=%d: left to llama-server's RAM prompt cache rather than "
                     "restored, to learn whether it serves (%d probes)", backend.url, blocks, tokens,
                     backend.ram.probes)
            return True
        return False

    @staticmethod
    def holds(backend: Backend, slot: Slot) -> bool:
        """Whether the server has likely copied what the idle `slot` holds to its RAM prompt cache already: with
        `--cache-idle-slots` (on with the RAM cache, by default) it copies every idle slot there whenever a request
        starts, so a request sent to it after this slot's last one ended did, once its answer began (a request only
        sent may reach the server's queue after a restore sent later: `Backend.launched_at`). A restore replaces a
        slot's cache without copying it; only then is that cache lost to the RAM. Not for a server whose RAM has
        missed every prompt left to it lately, or that said it has no RAM cache (one started with `--cache-ram 0`
        copies nothing)."""
        if backend.ram.present is False:
            return False
        recent = backend.ram.recent(time.monotonic())
        return (not recent or any(recent)) and backend.launched_at > slot.last_used > 0.0

    def restored_over(self, backend: Backend, previous: Content | None, idle_copied: bool,
                      saved: bool = False) -> None:
        """A restore replaced `previous` in a slot without the server copying it to its RAM: unless the server had
        copied it there as an idle slot already (`holds`, read before the restore), it is no longer there; when its
        file holds it (`previous.saved`, or `saved`: written just before the restore), it is remembered as lost, and
        `flow.unpinned` puts it back before requests go unpinned."""
        if previous is not None and not idle_copied:
            on_disk = previous.saved or saved
            self.server_caches.gone(backend.index, previous.chain, previous.key if on_disk else None)

    def keeps(self, backend: Backend, slot: Slot, held: Content) -> bool:
        """What the slot holds was left unsaved because the server's RAM prompt cache serves the returns (not worth
        a file while it does), and is not in that RAM yet (`holds`): a restore would replace it without the server
        copying it there, so it is saved first."""
        if held.saved or held.keep or not held.tokens or not backend.ram.served or self.holds(backend, slot):
            return False
        return held.session is not None or held.prompt is not None   # a prefix cache's meta file needs its prompt
