"""Slots: what each one holds, who may use it, and which one an unpinned request gets.

A slot is used by one task at a time. Inference and slot actions both queue on the
slot's FIFO lock, which is how the real server's deferral looks from outside: a save
sent while a slot streams blocks until the stream ends, then runs.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lpcache.mock_llama.tokens import lcp

SIMILARITY_THRESHOLD = 0.1  # llama-server's default --slot-prompt-similarity


@dataclass
class TaskInfo:
    """What GET /slots reports about the current or previous task of a slot."""

    id_task: int
    n_predict: int
    n_prompt_tokens_processed: int = 0
    n_prompt_tokens_cache: int = 0
    n_decoded: int = 0
    n_remain: int = 0


@dataclass
class Slot:
    id: int
    n_ctx: int
    # The tokens whose KV the slot holds: the prompt plus every generated token except
    # the last one, which the real server samples but never decodes.
    tokens: list[str] = field(default_factory=list)
    t_last_used: int = -1
    processing: bool = False
    task: TaskInfo | None = None
    claims: int = 0  # holders plus waiters; 0 means idle
    active: int = 0  # tasks currently running on the slot; must never exceed 1
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    restored: bool = False  # holds a restored file, not yet used (matters with MockConfig.swa)

    @property
    def idle(self) -> bool:
        return self.claims == 0


class SlotLike(Protocol):
    id: int
    tokens: list[str]
    t_last_used: int

    @property
    def idle(self) -> bool: ...


def wrap_slot_id(id_slot: int, n_slots: int) -> int | None:
    """The slot an id names, or None. Uses C++ ``%`` like the real server, so ids wrap
    and a negative id names a slot only when it is a multiple of ``n_slots``."""
    rem = int(math.fmod(id_slot, n_slots))
    return rem if rem >= 0 else None


def choose_slot(slots: Sequence[SlotLike], prompt: Sequence[str]) -> int | None:
    """The idle slot an unpinned prompt goes to, or None when every slot is busy.

    The best longest-common-prefix similarity above the threshold wins; without one,
    the least recently used idle slot (lowest id on ties).
    """
    idle = [s for s in slots if s.idle]
    if not idle:
        return None
    best: int | None = None
    best_sim = SIMILARITY_THRESHOLD
    for s in idle:
        if s.tokens and prompt:
            sim = lcp(s.tokens, prompt) / len(prompt)
            if sim > best_sim:
                best, best_sim = s.id, sim
    if best is not None:
        return best
    return min(idle, key=lambda s: (s.t_last_used, s.id)).id


class SlotPool:
    """All slots, with waiting for a particular slot or for any idle one."""

    def __init__(self, n_slots: int, n_ctx: int) -> None:
        self.slots = [Slot(id=i, n_ctx=n_ctx) for i in range(n_slots)]
        self._changed = asyncio.Event()
        self._clock = 0

    async def acquire(self, slot_id: int | None, prompt: Sequence[str] = ()) -> Slot:
        """Wait for the named slot, or (``None``) for the best idle slot, and hold it."""
        if slot_id is not None:
            slot = self.slots[slot_id]
        else:
            while (chosen := choose_slot(self.slots, prompt)) is None:
                await self._changed.wait()
            slot = self.slots[chosen]
        slot.claims += 1
        try:
            await slot.lock.acquire()
        except BaseException:
            slot.claims -= 1
            self._notify()
            raise
        slot.active += 1
        return slot

    def release(self, slot: Slot, *, used: bool) -> None:
        """Give the slot back; ``used`` marks it recently used (inference, not slot actions)."""
        if used:
            self._clock += 1
            slot.t_last_used = self._clock
        slot.active -= 1
        slot.claims -= 1
        slot.lock.release()
        self._notify()

    async def wait_idle(self, slots: Sequence[Slot]) -> None:
        """Return once nobody holds or waits for any of ``slots``."""
        while not all(s.idle for s in slots):
            await self._changed.wait()

    def _notify(self) -> None:
        # Waiters hold the old event; a fresh one is armed for the next change.
        self._changed.set()
        self._changed = asyncio.Event()
