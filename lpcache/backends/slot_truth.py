"""The truth about each slot: what lpcache believes a slot holds is checked against what the server says.

Beliefs go stale when something happens behind lpcache's back: the server restarted (its slots are empty), a
router unloaded a model, another model file was put behind the URL, or a request lpcache could not pin went into
a slot the server chose. So a backend that was silent for more than SLOTS_TRUSTED_FOR seconds, failed since, or is
*suspect* (an unpinned request went to it, an answer's `cache_n` contradicted a belief) is asked `GET /slots` before
its slots are used again: a slot whose token count (`n_prompt_tokens`) is not the one lpcache expects, or that has
run nothing since the server started, holds something else, and its belief is dropped (logged). Its model's
identity is read again too. Costs one small request after a pause, none under steady load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lpcache.backends import swap
from lpcache.backends.backend import Backend
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.swap import TOKEN_SLACK
from lpcache.errors import ProxyError

log = logging.getLogger("lpcache.slot_truth")

SLOTS_TRUSTED_FOR = 1.0  # seconds after a backend's last answer during which what its slots hold is not re-checked


def trusted(backend: Backend) -> bool:
    """Whether what lpcache believes the backend's slots hold goes unchecked now: it answered within
    SLOTS_TRUSTED_FOR, and nothing made it suspect since."""
    return (not backend.suspect and backend.last_seen > 0.0
            and time.monotonic() - backend.last_seen <= SLOTS_TRUSTED_FOR)


class SlotTruth:
    def __init__(self, backends: Sequence[Backend], pool: SlotPool,
                 on_restart: Callable[[Backend], None] | None = None) -> None:
        self.backends = list(backends)
        self.pool = pool
        self.on_restart = on_restart   # told when a backend's slots show it restarted
        self.corrected = 0   # beliefs dropped (metric)

    async def check(self) -> None:
        """Check the backends whose beliefs may be stale (see the module's docstring)."""
        now = time.monotonic()
        due = [b for b in self.backends if (b.suspect or now - b.last_seen > SLOTS_TRUSTED_FOR) and any(
            s.backend == b.index and s.content is not None and not s.busy for s in self.pool.slots)]
        if due:
            await asyncio.gather(*(self.check_backend(b) for b in due))

    async def check_backend(self, backend: Backend) -> None:
        was_silent = backend.last_seen == 0.0 or time.monotonic() - backend.last_seen > SLOTS_TRUSTED_FOR
        backend.suspect = False
        if was_silent:
            try:
                if await backend.learn_identity():
                    self.forget(backend, None, "the server runs another model")
            except ProxyError:
                return
        mine = [s for s in self.pool.slots if s.backend == backend.index and s.content is not None]
        for model in {s.model for s in mine}:
            try:
                listing = await swap.listing(backend.client, model)
            except ProxyError:
                continue   # unreachable: the request will find out and fail over
            if listing is None:
                continue   # no /slots on this server: lpcache cannot tell
            counts = {s.get("id"): s.get("n_prompt_tokens") for s in listing}
            self.restart_seen(backend, listing, model)
            backend.loadable.slot_ctx.update({(model, s["id"]): s["n_ctx"] for s in listing if isinstance(
                s.get("id"), int) and isinstance(s.get("n_ctx"), int) and s["n_ctx"] > 0})
            working = {s.get("id") for s in listing if s.get("is_processing")}
            lost = []
            for slot in mine:
                # a slot another replica uses (REDIS_URL) changes under its own lease: not a false belief
                if slot.model != model or slot.taken or slot.id in working or slot.content is None:
                    continue
                n = counts.get(slot.id)
                expected = slot.content.tokens
                if not n or (expected is not None and isinstance(n, int) and abs(n - expected) > TOKEN_SLACK):
                    lost.append((slot, n, expected))
            for slot, _, _ in lost:
                slot.content = None
            if lost:
                self.corrected += len(lost)
                log.warning("slots_emptied backend=%s model=%s slots=%s: the server holds something else there "
                            "(restarted, unloaded, or used by a request lpcache did not pin); their caches are "
                            "restored from disk when asked for", backend.url, model or "-",
                            ",".join(f"{s.id}(tokens {n} not {e})" for s, n, e in lost))
        backend.last_seen = time.monotonic()

    def restart_seen(self, backend: Backend, listing: list[dict[str, Any]], model: str | None = None) -> None:
        """Tell `on_restart` when the listing (of one model's instance on a router) says the server restarted since
        it was last seen: no slot has run a task since it started, or the highest task number went back (tasks are
        numbered from 0 at each start, each instance of a router's on its own)."""
        tasks = [s["id_task"] for s in listing if isinstance(s.get("id_task"), int)]
        mark = max(tasks, default=-1)
        restarted = bool(listing) and (not tasks or mark < backend.task_marks.get(model, -1))
        backend.task_marks[model] = mark
        if restarted and self.on_restart is not None:
            self.on_restart(backend)

    def forget(self, backend: Backend, model: str | None, why: str) -> None:
        for slot in self.pool.slots:
            if slot.backend == backend.index and (model is None or slot.model == model) and not slot.busy:
                slot.content = None
        log.warning("slots_forgotten backend=%s: %s", backend.url, why)
