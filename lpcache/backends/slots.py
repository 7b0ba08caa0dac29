"""Every slot of every backend: what it holds (`Content`) and who is using it (`Slot`). Which slot a request gets is
`placement`'s; handing slots out, in turn, `slot_pool`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lpcache.backends.loadable import Loadable
from lpcache.cache.meta_files import Candidate
from lpcache.cache.prefix import Prompt


@dataclass(frozen=True, slots=True)
class Content:
    """What a slot's KV cache holds, as far as lpcache knows: the file name it is saved under (a prefix cache's file,
    or a session's `<route tag>_<id>.bin`) and the exact identity chain of its last prompt (`Prompt.exact`)."""

    key: str
    chain: tuple[int, ...]
    saved: bool = False           # a file of this key is on disk and matches the slot
    keep: bool = False            # worth a save before it is lost: a big prompt's cache, or a session's
    session: str | None = None    # the session id, for a session's cache
    prompt: Prompt | None = None  # a prefix cache's prompt (for its meta file when it is saved later)
    model: str = ""               # the request's model: its route, and on a router the instance that holds it
    tokens: int | None = None     # tokens in the slot when known (checked against GET /slots n_prompt_tokens)
    fingerprint: str | None = None  # the identity of the model that made it (`backends.backend.Backend.fingerprint`)

    @property
    def dirty(self) -> bool:
        """Worth keeping, and changed since its last save: saved before anything replaces it."""
        return self.keep and not self.saved


@dataclass(eq=False)
class Slot:
    backend: int          # index into the pool's backend list
    id: int               # the slot id on its llama-server
    kv_cache: bool = True
    slot_save_path: str | None = None
    url: str = ""
    busy: bool = False
    used: bool = False    # has served a request through lpcache
    last_used: float = 0.0
    content: Content | None = None
    pending: Content | None = None   # while busy: what it will hold once the request in it is done
    model: str | None = None         # on a router: the model whose instance has this slot
    phase: str = ""                  # while busy: "prefill", "generate", "save" (for the cost of waiting)
    free_at: float | None = None     # while busy: when it is expected to be free (monotonic), when known
    stream: bool = False             # while busy: its request streams (its first token is seen: `first_token_at`)
    sent_at: float | None = None     # while busy: when its request went to the server (monotonic)
    first_token_at: float | None = None   # while busy: when its answer's first token came (its prefill was over)
    computing: int = 0               # while busy: identity blocks of its prompt the server computes (not cached)
    answer_tokens: int | None = None  # while busy: the most tokens its answer may have (max_tokens), when said
    client: str | None = None        # while busy: whose request holds it (`admission`: fair shares)
    priority: int = 1                # while busy: the class of that request (`admission.CLASSES` index)
    taken_at: float = 0.0            # while busy with a request: since when (monotonic; its hold time)
    replans: list[Callable[[], None]] = field(default_factory=list)   # the waits planned on it, to decide again
    on_handover: list[Callable[[], None]] = field(default_factory=list)   # every wait planned on it, ended when
                                                                         # it goes to another request
                                                                         # (`handed_over`)
    filling: asyncio.Event | None = None   # set once its new holder saved what it held (`handed_over`)
    on_release: asyncio.Event | None = None   # set when it is given back (`SlotPool.until_released`)
    elsewhere: str | None = None     # with REDIS_URL: the replica whose request holds it (`fleet`) ...
    elsewhere_until: float = 0.0     # ... until then at most (monotonic; its lease's expiry as last seen)
    restoring: str | None = None     # ... and the saved cache that request restores into it first, if any
    loadable: Loadable | None = None   # what its server can load (`loadable`: KV layout, contexts), shared

    @property
    def taken(self) -> bool:
        """Busy here, or held by another replica's request (as far as this replica knows)."""
        return self.busy or (self.elsewhere is not None and time.monotonic() < self.elsewhere_until)

    @property
    def awaited(self) -> bool:
        """A request's wait plan is this slot (one at most: `wait_plan`)."""
        return bool(self.replans)

    @property
    def name(self) -> str:
        return f"{self.url}#{self.id}"

    def can_read(self, candidate: Candidate | None) -> bool:
        """Whether a saved cache's file is readable by this slot's server, and loadable into this slot."""
        return (candidate is not None and self.kv_cache and candidate.entry.readable_by(self.url, self.slot_save_path)
                and (self.loadable is None or self.loadable.fits(candidate.entry, self.model, self.id)))
