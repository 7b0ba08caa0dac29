"""Every slot of every backend: what it holds, who is using it, and which one a request gets.

A slot is used by one request at a time (its lock is the `busy` flag, changed only on the event loop). A request
that finds no idle slot waits in a FIFO queue for any slot, not for one in particular, so no request queues behind
a busy slot while another is idle. The choice itself is a pure function of the idle slots, the prompt and the best
saved cache, so it is tested without a server.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import SlotsBusy
from .index import Candidate
from .prefix import Prompt, common_prefix


@dataclass(frozen=True, slots=True)
class Content:
    """What a slot's KV cache holds, as far as lpcache knows: the file name it is saved under (a prefix cache's key,
    or a session's `<route tag>_<id>.bin`) and the block chain of its last prompt."""

    key: str
    chain: tuple[int, ...]
    saved: bool = False           # a file of this key is on disk and matches the slot
    keep: bool = False            # worth a save before it is lost: a big prompt's cache, or a session's
    session: str | None = None    # the session id, for a session's cache
    prompt: Prompt | None = None  # a prefix cache's prompt (for its meta file when it is saved later)
    model: str = ""               # the request's model: its route, and on a router the instance that holds it

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

    @property
    def name(self) -> str:
        return f"{self.url}#{self.id}"

    def can_read(self, candidate: Candidate | None) -> bool:
        """Whether a saved cache's file is readable by this slot's server."""
        return candidate is not None and self.kv_cache and candidate.entry.readable_by(self.url, self.slot_save_path)


@dataclass(frozen=True, slots=True)
class Choice:
    """The slot a request gets, and the saved cache to restore into it first (None: use what it holds)."""

    slot: Slot
    restore: Candidate | None = None
    resident: int = 0  # blocks of the prompt the slot already holds


def choose(idle: Sequence[Slot], prompt: Prompt | None, candidate: Candidate | None,
           session: str | None = None, homes: frozenset[int] = frozenset()) -> Choice:
    """Pick among idle slots.

    0. In session mode (`session`: the session's file name): the slot that holds the session, else the least
       recently used one (never-used first) on a backend whose folder has the session's file (`homes`), else
       anywhere; the caller swaps the session in.
    1. A slot that already holds at least as long a prefix as the best saved cache: no restore at all.
    2. Else, when a saved cache shares more: restore it into a slot whose server can read its file.
    3. Else a never-used slot, else the least recently used one.
    """
    if session is not None:
        for slot in idle:
            if slot.content is not None and slot.content.key == session:
                return Choice(slot, None, len(slot.content.chain))
        at_home = [s for s in idle if s.backend in homes]
        return Choice(_coldest(at_home or idle), None, 0)
    best_slot: Slot | None = None
    best = (0, 0.0)  # (shared blocks, last use): the longest resident prefix, the freshest on a tie
    if prompt is not None and prompt.chain:
        for slot in idle:
            if slot.content is not None:
                rank = (common_prefix(slot.content.chain, prompt.chain), slot.last_used)
                if rank[0] and rank > best:
                    best_slot, best = slot, rank
    best_shared = best[0]
    disk = candidate.shared if candidate is not None else 0
    if best_slot is not None and best_shared >= disk:
        return Choice(best_slot, None, best_shared)
    if candidate is not None:
        readers = [s for s in idle if s.can_read(candidate)]
        if readers:
            return Choice(_coldest(readers), candidate, 0)
    if best_slot is not None:
        return Choice(best_slot, None, best_shared)
    return Choice(_coldest(idle), None, 0)


def worth_waiting_for(slots: Sequence[Slot], prompt: Prompt | None, candidate: Candidate | None,
                      allowed: Callable[[Slot], bool] | None = None, session: str | None = None) -> Slot | None:
    """A busy slot that will hold far more of the prompt than any idle slot or saved cache: typically the previous
    turn of the same conversation, still generating or being saved. Waiting for it beats a prefill elsewhere.
    "Far more": at least a quarter of the prompt's blocks (and 2 blocks) beyond the best alternative. In session
    mode: the busy slot that holds (or is about to hold) the session."""
    if session is not None:
        for slot in slots:
            held = (slot.pending or slot.content) if slot.busy else None
            if held is not None and held.key == session and (allowed is None or allowed(slot)):
                return slot
        return None
    if prompt is None or not prompt.chain:
        return None
    best: Slot | None = None
    busy_shared, other = 0, candidate.shared if candidate is not None else 0
    for slot in slots:
        if allowed is not None and not allowed(slot):
            continue
        held = (slot.pending or slot.content) if slot.busy else slot.content
        shared = common_prefix(held.chain, prompt.chain) if held is not None else 0
        if slot.busy and shared > busy_shared:
            best, busy_shared = slot, shared
        elif not slot.busy:
            other = max(other, shared)
    if best is not None and busy_shared - other >= max(2, len(prompt.chain) // 4):
        return best
    return None


def preferred(slots: Sequence[Slot], prompt: Prompt | None, candidate: Candidate | None,
              allowed: Callable[[Slot], bool] | None = None, session: str | None = None,
              homes: frozenset[int] = frozenset()) -> Callable[[Slot], bool] | None:
    """The slots worth a bounded wait when none of them is idle, rather than an idle slot elsewhere that would
    prefill: the busy slot of `worth_waiting_for`; in session mode, the slots of the backends whose folder has the
    session's file; in prefix mode, the slots that can read the saved cache when it holds far more of the prompt than
    any idle slot (a server with one slot is often busy for the few milliseconds of the previous request's save)."""
    target = worth_waiting_for(slots, prompt, candidate, allowed, session)
    if target is not None:
        return lambda s: s is target
    ok: Callable[[Slot], bool] = allowed or (lambda s: True)

    def only(want: Callable[[Slot], bool]) -> Callable[[Slot], bool] | None:
        mine = [s for s in slots if ok(s) and want(s)]
        return want if mine and all(s.busy for s in mine) else None

    if session is not None:
        return only(lambda s: s.backend in homes) if homes else None
    if candidate is None or prompt is None or not prompt.chain:
        return None
    idle_best = max((common_prefix(s.content.chain, prompt.chain) for s in slots
                     if not s.busy and ok(s) and s.content is not None), default=0)
    if candidate.shared - idle_best < max(2, len(prompt.chain) // 4):
        return None
    return only(lambda s: s.can_read(candidate))


def _coldest(slots: Sequence[Slot]) -> Slot:
    """A never-used slot first, else the least recently used; ties go to the lowest backend, then slot id."""
    return min(slots, key=lambda s: (s.used, s.last_used, s.backend, s.id))


@dataclass(eq=False)
class _Waiter:
    prompt: Prompt | None
    candidate: Candidate | None
    allowed: Callable[[Slot], bool] | None
    session: str | None
    homes: frozenset[int]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SlotPool:
    """Hands out slots: at once when one is idle and nobody waits, else in arrival order as slots come free."""

    def __init__(self, slots: Sequence[Slot], wait_timeout: float = 300.0) -> None:
        self.slots = list(slots)
        self.wait_timeout = wait_timeout
        self._waiters: deque[_Waiter] = deque()

    def idle(self, allowed: Callable[[Slot], bool] | None = None) -> list[Slot]:
        return [s for s in self.slots if not s.busy and (allowed is None or allowed(s))]

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def add(self, slots: Sequence[Slot]) -> None:
        """More slots (a backend that came up told its real slot count)."""
        self.slots.extend(slots)
        self.wake()

    async def acquire(self, prompt: Prompt | None, candidate: Candidate | None = None,
                      allowed: Callable[[Slot], bool] | None = None, timeout: float | None = None,
                      session: str | None = None, homes: frozenset[int] = frozenset()) -> Choice:
        """Take a slot (among those `allowed`, when given); raise SlotsBusy (503) when none comes free within the
        wait timeout (`timeout`, else the pool's)."""
        idle = self.idle(allowed)
        if idle and not self._waiters:
            return self._take(choose(idle, prompt, candidate, session, homes))
        waiter = _Waiter(prompt, candidate, allowed, session, homes)
        self._waiters.append(waiter)
        self.wake()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands just as the slot is
            # handed over, and the cancelled caller would keep a slot it never releases.
            async with asyncio.timeout(self.wait_timeout if timeout is None else timeout):
                return await asyncio.shield(waiter.future)
        except (TimeoutError, asyncio.CancelledError) as e:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result().slot)  # it got a slot just as it gave up
            waiter.future.cancel()
            if isinstance(e, TimeoutError):
                raise SlotsBusy("all slots busy", code="all_slots_busy") from None
            raise

    def release(self, slot: Slot, content: Content | None | bool = True, used: bool = True) -> None:
        """Give a slot back. `content`: what it now holds (True: unchanged, None: unknown). `used` False: it
        served no request (an idle save), so it keeps its place in the least-recently-used order."""
        if not slot.busy:
            return
        slot.busy = False
        slot.pending = None
        if used:
            slot.last_used = time.monotonic()
        if content is not True:
            slot.content = content if isinstance(content, Content) else None
        self.wake()

    def take_idle(self, slot: Slot, force: bool = False) -> bool:
        """Take this slot for lpcache's own work (an idle save) when it is idle and no request waits for a slot
        (`force`: even then, for a save that cannot wait)."""
        if slot.busy or (self._waiters and not force):
            return False
        slot.busy = True
        return True

    def _take(self, choice: Choice) -> Choice:
        choice.slot.busy = True
        choice.slot.used = True
        return choice

    def wake(self) -> None:
        """Hand idle slots to the waiters, in arrival order; a waiter none of whose allowed slots is idle keeps
        its place without holding up the ones behind it."""
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            idle = self.idle(waiter.allowed)
            if not idle:
                if not self.idle():
                    return
                continue
            self._waiters.remove(waiter)
            choice = choose(idle, waiter.prompt, waiter.candidate, waiter.session, waiter.homes)
            waiter.future.set_result(self._take(choice))
