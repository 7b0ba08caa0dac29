"""Every slot of every backend: what it holds, who is using it, and which one a request gets.

A slot is used by one request at a time (its lock is the `busy` flag, changed only on the event loop). A request
that finds no idle slot waits in a FIFO queue for any slot, not for one in particular, so no request queues behind
a busy slot while another is idle. The choice itself is a pure function of the idle slots, the prompt and the best
saved cache, so it is tested without a server.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from .errors import SlotsBusy
from .index import Candidate
from .prefix import Prompt, common_prefix


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
    fingerprint: str | None = None  # the identity of the model that made it (`backends.Backend.fingerprint`)

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
    replans: list[Callable[[], None]] = field(default_factory=list)   # the waits planned on it, to decide again
    on_handover: list[Callable[[], None]] = field(default_factory=list)   # every wait planned on it, ended when
                                                                         # it goes to another request
                                                                         # (`handed_over`)
    filling: asyncio.Event | None = None   # set once its new holder saved what it held (`handed_over`)
    on_release: asyncio.Event | None = None   # set when it is given back (`SlotPool.until_released`)
    elsewhere: str | None = None     # with REDIS_URL: the replica whose request holds it (`fleet`) ...
    elsewhere_until: float = 0.0     # ... until then at most (monotonic; its lease's expiry as last seen)
    restoring: str | None = None     # ... and the saved cache that request restores into it first, if any

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
        """Whether a saved cache's file is readable by this slot's server."""
        return candidate is not None and self.kv_cache and candidate.entry.readable_by(self.url, self.slot_save_path)


@dataclass(frozen=True, slots=True)
class Choice:
    """The slot a request gets, and the saved cache to restore into it first (None: use what it holds)."""

    slot: Slot
    restore: Candidate | None = None
    resident: int = 0       # identity blocks of the prompt the slot already holds
    skipped: bool = False   # a saved cache held more, but restoring it would take longer than the prefill
    warm: bool = False      # taken because the server's RAM prompt cache likely holds the prompt ...
    warm_blocks: int = 0    # ... this many of its identity blocks


Pays = Callable[[Slot, Candidate, int], bool]


def choose(idle: Sequence[Slot], prompt: Prompt | None, candidate: Candidate | None,
           session: str | None = None, homes: frozenset[int] = frozenset(), pays: Pays | None = None,
           warm: tuple[int, int, bool] | None = None, kept: Callable[[str], bool] | None = None,
           load: Mapping[int, int] | None = None) -> Choice:
    """Pick among idle slots.

    0. In session mode (`session`: the session's file name): the slot that holds the session, else the least
       recently used one (never-used first) on a backend whose folder has the session's file (`homes`), else
       anywhere; the caller swaps the session in.
    1. When a saved cache holds more of the prompt than any idle slot: restore it into the coldest slot whose server
       can read it, if `pays(slot, candidate, blocks gained over the best resident slot)` (default: yes); a slot
       whose cache is on disk (`kept(file)`) or unknown first: a restore replaces a slot's cache without the server
       copying it to its RAM, so a cache held nowhere else would be lost.
    2. Else the slot that already holds the longest exact prefix of the prompt: no restore at all; unless the server
       whose RAM prompt cache likely holds more of it (`warm`: backend, blocks, and whether its RAM is relied on
       over a file, `server_cache.RamWatch.rely`) has an idle slot that holds something else, which is taken
       instead (a pinned request there makes the server look in RAM). A server whose RAM is relied on is taken so
       before step 1 too, when its RAM likely holds as much as the saved cache.
    3. Else a never-used slot, else the least recently used one.
    Among slots that would compute (a restore's target, a prefill's), those of the least-loaded backend first
    (`load`: slots taken per backend, here and by other replicas): its compute is shared by fewer requests.
    """
    if session is not None:
        for slot in idle:
            if slot.content is not None and slot.content.key == session:
                return Choice(slot, None, len(slot.content.chain))
        at_home = [s for s in idle if s.backend in homes]
        return Choice(_coldest(at_home or idle, load), None, 0)
    best_slot, best_shared = resident(idle, prompt)
    ram = _warm_slot(idle, prompt, warm, best_shared)
    if ram is not None and warm is not None and warm[2] and candidate is not None and warm[1] >= candidate.shared:
        return Choice(ram, None, 0, warm=True, warm_blocks=warm[1])   # left to the server's RAM: no disk restore
    if candidate is not None and candidate.shared > best_shared:
        readers = [s for s in idle if s.can_read(candidate)]
        if readers:
            spare = [s for s in readers if s.content is None or kept is None or kept(s.content.key)
                     or (s.content.session is not None and s.content.saved)]
            target = _coldest(spare or readers, load)
            if pays is None or pays(target, candidate, candidate.shared - best_shared):
                return Choice(target, candidate, 0)
            if best_slot is not None:
                return Choice(best_slot, None, best_shared, skipped=True)
            return Choice(_coldest(idle, load), None, 0, skipped=True)
    if ram is not None and warm is not None:
        return Choice(ram, None, 0, warm=True, warm_blocks=warm[1])
    if best_slot is not None:
        return Choice(best_slot, None, best_shared)
    return Choice(_coldest(idle, load), None, 0)


def _warm_slot(idle: Sequence[Slot], prompt: Prompt | None, warm: tuple[int, int, bool] | None,
               resident_blocks: int) -> Slot | None:
    """When the server whose RAM prompt cache likely holds more of the prompt than any idle slot (`warm`: backend,
    blocks, whether its RAM is relied on) has an idle slot holding something else: the one sharing least with the
    prompt (the server looks in RAM when the slot shares under half of it)."""
    if warm is None or prompt is None or warm[1] < resident_blocks + 2:
        return None
    if not warm[2] and warm[1] < max(1, math.ceil(RESIDENT_MIN_SHARE * len(prompt.exact))):
        return None   # a server whose RAM is not relied on may not have it: only for a large part of the prompt
    there = [s for s in idle if s.backend == warm[0] and s.used and s.content is not None]
    if not there:
        return None
    return min(there, key=lambda s: (common_prefix(s.content.chain, prompt.exact) if s.content else 0,
                                     s.last_used, s.id))


RESIDENT_MIN_SHARE = 0.1   # a slot sharing less of the prompt is not worth taking for it (llama-server's -sps)


def resident(slots: Sequence[Slot], prompt: Prompt | None) -> tuple[Slot | None, int]:
    """The slot holding the longest exact prefix of the prompt (the freshest on a tie), and that many blocks; a
    slot sharing under RESIDENT_MIN_SHARE of the prompt (a common system prompt of another conversation) does not
    count: taking it would push that conversation out for a few tokens."""
    best_slot: Slot | None = None
    best = (0, 0.0)
    if prompt is not None and prompt.exact:
        least = max(1, math.ceil(RESIDENT_MIN_SHARE * len(prompt.exact)))
        for slot in slots:
            if slot.content is not None:
                rank = (common_prefix(slot.content.chain, prompt.exact), slot.last_used)
                if rank[0] >= least and rank > best:
                    best_slot, best = slot, rank
    return best_slot, best[0]


Budget = Callable[[Slot | None, int, bool], float]
"""`budget(slot, blocks, beside)`: the longest wait for the busy `slot` that still beats prefilling `blocks` on
another slot; `beside`: that other slot would be on the busy slot's own server, prefilling beside it."""


@dataclass(frozen=True)
class WaitPlan:
    """Busy slots worth waiting for (`wanted`), at most `seconds`, rather than taking an idle slot at once.
    `target`: the one busy slot waited for, when it is one; `recheck` gives the wait left (seconds from now) when
    that slot's request progresses (its first token: `SlotPool.progressed`)."""

    wanted: Callable[[Slot], bool]
    seconds: float
    target: Slot | None = None
    recheck: Callable[[], float] | None = None


def wait_plan(slots: Sequence[Slot], prompt: Prompt | None, candidate: Candidate | None,
              allowed: Callable[[Slot], bool] | None, session: str | None, homes: frozenset[int],
              budget: Budget) -> WaitPlan | None:
    """Whether to wait for a busy slot, and how long: a cost decision. `budget(slot, blocks, beside)` is the longest
    wait that still beats prefilling `blocks` elsewhere (0: do not wait), from the learnt speeds and what the busy
    slot is doing (`Slot.phase`, `Slot.free_at`).

    - In session mode: the busy slot that holds (or is about to hold) the session; else, when the session's file is
      only on busy backends (`homes`), their slots.
    - In prefix mode: the busy slot that will hold more of the prompt than any idle slot or saved cache (the previous
      turn of the same conversation, still answered or saved, or a request sharing a long prefix that arrived just
      before: an agent harness, a document); else, when the best saved cache is only readable by busy slots, those.
      When no idle slot is on another server, taking one means prefilling beside the busy slot on its own server
      (`beside`): the two prefills share that server's compute, so waiting out the busy slot's prefill costs
      nothing, only its answer and save do.
    """
    ok: Callable[[Slot], bool] = allowed or (lambda s: True)
    n = len(prompt.exact) if prompt is not None else 0
    if session is not None:
        for slot in slots:
            held = (slot.pending or slot.content) if slot.taken else None
            if held is not None and held.key == session and ok(slot):
                seconds = budget(slot, n, False)
                return WaitPlan(_only(slot), seconds, slot) if seconds > 0 else None
        mine = [s for s in slots if ok(s) and s.backend in homes]
        if homes and mine and all(s.taken for s in mine):
            seconds = budget(_soonest(mine), n, False)
            return WaitPlan(lambda s: s.backend in homes, seconds) if seconds > 0 else None
        return None
    if prompt is None or not prompt.exact:
        return None
    best: Slot | None = None
    busy_shared, idle_shared = 0, 0
    for slot in slots:
        if not ok(slot):
            continue
        taken = slot.taken
        held = (slot.pending or slot.content) if taken else slot.content
        shared = common_prefix(held.chain, prompt.exact) if held is not None else 0
        if taken and shared > busy_shared and not slot.awaited:   # one request waits for a slot, not several
            best, busy_shared = slot, shared
        elif not taken:
            idle_shared = max(idle_shared, shared)
    disk = candidate.shared if candidate is not None else 0
    least = max(1, math.ceil(RESIDENT_MIN_SHARE * len(prompt.exact)))
    if best is not None and busy_shared >= least and busy_shared > max(idle_shared, disk):
        idle_backends = {s.backend for s in slots if ok(s) and not s.taken}
        beside = idle_backends == {best.backend}   # going now means prefilling on that server, beside it
        gain, target = busy_shared - max(idle_shared, disk), best
        seconds = budget(target, gain, beside)
        if seconds > 0:
            return WaitPlan(_only(target), seconds, target, lambda: budget(target, gain, beside))
    if candidate is not None and disk > idle_shared:
        readers = [s for s in slots if ok(s) and s.can_read(candidate)]
        if readers and all(s.taken for s in readers):
            seconds = budget(_soonest(readers), disk - idle_shared, False)
            if seconds > 0:
                return WaitPlan(lambda s: s.can_read(candidate), seconds)
    return None


def _only(target: Slot) -> Callable[[Slot], bool]:
    return lambda s: s is target


def _soonest(slots: Sequence[Slot]) -> Slot:
    """The busy slot expected to be free first (unknown: last)."""
    return min(slots, key=lambda s: (s.free_at is None, s.free_at or 0.0, s.backend, s.id))


def _coldest(slots: Sequence[Slot], load: Mapping[int, int] | None = None) -> Slot:
    """A slot of the least-loaded backend (`load`), then a never-used one, else the least recently used; ties go to
    the lowest backend, then slot id."""
    return min(slots, key=lambda s: (load.get(s.backend, 0) if load else 0, s.used, s.last_used, s.backend, s.id))


Lookup = Callable[[], Candidate | None]


def _no_candidate() -> Candidate | None:
    return None


@dataclass(eq=False)
class Want:
    """What a request asks of the pool: its prompt, how to find its best saved cache (called when a slot is handed
    out, so a cache saved or pruned meanwhile is seen), the slots it may take, its session, the backends holding
    the session's file, and whether a restore pays (`choose`)."""

    prompt: Prompt | None = None
    lookup: Lookup = _no_candidate
    allowed: Callable[[Slot], bool] | None = None
    session: str | None = None
    homes: frozenset[int] = frozenset()
    pays: Pays | None = None
    protect: Callable[[str], None] | None = None    # called with the candidate's key when one is chosen
    unprotect: Callable[[str], None] | None = None  # ... and when the slot is given back unused
    warm: Callable[[], tuple[int, int, bool] | None] | None = None   # the server whose RAM likely holds it
    kept: Callable[[str], bool] | None = None        # whether a cache's file is on disk
    answer_tokens: int | None = None                 # the request's max_tokens, when it says

    def choose(self, idle: Sequence[Slot], load: Mapping[int, int] | None = None) -> Choice:
        choice = choose(idle, self.prompt, self.lookup(), self.session, self.homes, self.pays,
                        self.warm() if self.warm is not None else None, self.kept, load)
        if choice.restore is not None and self.protect is not None:
            self.protect(choice.restore.entry.key)   # on the event loop, before anything else can prune it
        return choice

    def given_back(self, choice: Choice) -> None:
        if choice.restore is not None and self.unprotect is not None:
            self.unprotect(choice.restore.entry.key)

    def pending(self) -> Content | None:
        """What the request will leave in its slot (told to the other replicas when it claims the slot)."""
        if self.prompt is None:
            return None
        return Content(self.session or self.prompt.key, self.prompt.exact, session=self.session)

    def only(self, wanted: Callable[[Slot], bool]) -> Want:
        allowed = self.allowed
        return replace(self, allowed=wanted if allowed is None else (lambda s: allowed(s) and wanted(s)))


@dataclass(eq=False)
class _Waiter:
    want: Want
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Refused(Exception):
    """The slot chosen is another replica's (its claim was refused): the caller plans its wait again."""


class Claims(Protocol):
    """Slot leases across replicas (`fleet.Fleet`, with REDIS_URL): a slot the pool hands out locally is claimed
    before use; another replica's live lease on it makes the pool choose again."""

    async def claim(self, slot: Slot, want: Want | None = None, restore: str | None = None) -> bool: ...

    def released(self, slot: Slot) -> None: ...

    def valid(self, slot: Slot) -> bool: ...

    def saving(self, slot: Slot) -> None: ...


class SlotPool:
    """Hands out slots: at once when one is idle and nobody waits, else in arrival order as slots come free."""

    def __init__(self, slots: Sequence[Slot], wait_timeout: float = 300.0) -> None:
        self.slots = list(slots)
        self.wait_timeout = wait_timeout
        self._waiters: deque[_Waiter] = deque()
        self.claims: Claims | None = None   # set with REDIS_URL
        # When a list (tests): (slot name, wall-clock time, "take" or "give") as this replica starts and stops
        # using a slot; with `claims`, "take" once the slot is claimed.
        self.trace: list[tuple[str, float, str]] | None = None

    def idle(self, allowed: Callable[[Slot], bool] | None = None) -> list[Slot]:
        return [s for s in self.slots if not s.taken and (allowed is None or allowed(s))]

    def ours(self, slot: Slot) -> bool:
        """Whether this replica may still act on a slot it holds (restore into it, save from it): with `claims`,
        its lease has not lapsed (a replica cut from Redis longer than the lease's expiry stops writing)."""
        return self.claims is None or self.claims.valid(slot)

    def load(self) -> dict[int, int]:
        """Slots taken per backend (busy here, or held by another replica)."""
        taken: dict[int, int] = {}
        for s in self.slots:
            if s.taken:
                taken[s.backend] = taken.get(s.backend, 0) + 1
        return taken

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def add(self, slots: Sequence[Slot]) -> None:
        """More slots (a backend that came up told its real slot count)."""
        self.slots.extend(slots)
        self.wake()

    async def acquire(self, want: Want, timeout: float | None = None) -> Choice:
        """Take a slot (among those `want.allowed`); raise SlotsBusy (503) when none comes free within the wait
        timeout (`timeout`, else the pool's). With `claims` (REDIS_URL), the slot is claimed across replicas before
        it is returned; one another replica holds is passed over (chosen again)."""
        return (await self._claimed(want, timeout, None, refusals=False))[0]

    async def take(self, want: Want, plan: WaitPlan | None, timeout: float | None = None,
                   replan: Callable[[], WaitPlan | None] | None = None) -> tuple[Choice, bool]:
        """Take a slot, waiting first for the busy slots `plan` names (for at most `plan.seconds`, decided again
        when the awaited slot's request progresses: `plan.recheck`), then for any allowed slot, in one place in the
        line: a request whose plan runs out keeps its turn. Returns the choice and whether it came from the plan.
        The whole wait is bounded by the timeout (SLOT_WAIT_TIMEOUT). A slot chosen but found to be another
        replica's (REDIS_URL) makes the plan be made again (`replan`), now that this replica knows it is busy."""
        total = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        while True:
            try:
                return await self._claimed(want, max(deadline - time.monotonic(), 0.0), plan,
                                           refusals=replan is not None)
            except Refused:
                assert replan is not None
                plan = replan()

    async def _claimed(self, want: Want, timeout: float | None, plan: WaitPlan | None,
                       refusals: bool) -> tuple[Choice, bool]:
        """`_acquire`, then with `claims` the claim across replicas; with `refusals`, `Refused` when another
        replica holds the slot chosen (the caller plans again), else that slot is passed over."""
        total = self.wait_timeout if timeout is None else timeout
        if self.claims is None:
            choice, planned = await self._acquire(want, total, plan)
            return self._traced(choice), planned
        deadline = time.monotonic() + total
        while True:
            choice, planned = await self._acquire(want, max(deadline - time.monotonic(), 0.0), plan)
            believed = choice.slot.content
            try:
                ours = await self.claims.claim(choice.slot, want,
                                               choice.restore.entry.key if choice.restore is not None else None)
            except BaseException:
                want.given_back(choice)
                self._unclaimed(choice.slot)
                raise
            if ours:
                if choice.slot.content is believed:
                    return self._traced(choice), planned
                # the claim told what the slot really holds (another replica used it meanwhile): decide again
                # what to do with this slot, now that it is ours
                want.given_back(choice)
                return self._traced(want.choose([choice.slot], self.load())), planned
            want.given_back(choice)
            self._unclaimed(choice.slot)   # marked `elsewhere` by the claim: not chosen again meanwhile
            if refusals:
                raise Refused(choice.slot.name)

    def _traced(self, choice: Choice) -> Choice:
        if self.trace is not None:
            self.trace.append((choice.slot.name, time.time(), "take"))
        return choice

    def _unclaimed(self, slot: Slot) -> None:
        """A slot handed out here but not ours across replicas: idle again here, as it was."""
        slot.busy = False
        self._filling_over(slot)
        self.wake()

    async def _acquire(self, want: Want, timeout: float, plan: WaitPlan | None) -> tuple[Choice, bool]:
        """Wait in line for a slot `want` allows; with a `plan`, only for the slots it names until its time is up
        (`plan.seconds`, decided again at the awaited slot's progress, never beyond the first), then for any: the
        waiter widens where it stands in the line. Returns the choice and whether it came while the plan held."""
        narrow = want.only(plan.wanted) if plan is not None else want
        idle = self.idle(narrow.allowed)
        if idle and not self._waiters:
            return self._take(narrow.choose(idle, self.load())), plan is not None
        waiter = _Waiter(narrow)
        self._waiters.append(waiter)
        self.wake()
        loop = asyncio.get_running_loop()
        widening: asyncio.TimerHandle | None = None
        replan: Callable[[], None] | None = None
        target = plan.target if plan is not None else None

        def widen() -> None:
            if not waiter.future.done() and waiter.want is narrow:
                waiter.want = want
                self.wake()

        if plan is not None and waiter.want is narrow:
            bound = loop.time() + max(plan.seconds, 0.0)
            widening = loop.call_at(bound, widen)
            if target is not None:
                target.on_handover.append(widen)   # went to a request ahead in the line: waiting on is pointless
            if target is not None and plan.recheck is not None:
                again = plan.recheck

                def replan() -> None:
                    nonlocal widening
                    if widening is not None:
                        widening.cancel()
                    seconds = again()
                    if seconds <= 0:
                        widen()   # the wait no longer pays: any slot, now
                    else:
                        widening = loop.call_at(min(bound, loop.time() + seconds), widen)

                target.replans.append(replan)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands just as the slot is
            # handed over, and the cancelled caller would keep a slot it never releases.
            async with asyncio.timeout(timeout):
                choice = await asyncio.shield(waiter.future)
            return choice, plan is not None and waiter.want is narrow
        except (TimeoutError, asyncio.CancelledError) as e:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                got = waiter.future.result()   # it got a slot just as it gave up
                want.given_back(got)
                self.release(got.slot)
            waiter.future.cancel()
            if isinstance(e, TimeoutError):
                raise SlotsBusy("all slots busy", code="all_slots_busy") from None
            raise
        finally:
            if widening is not None:
                widening.cancel()
            if target is not None and replan is not None:
                target.replans.remove(replan)
            if target is not None and widen in target.on_handover:
                target.on_handover.remove(widen)

    def progressed(self, slot: Slot) -> None:
        """The request in `slot` got its first token: the requests waiting for that slot decide how long again."""
        for replan in list(slot.replans):
            replan()

    def release(self, slot: Slot, content: Content | None | bool = True, used: bool = True) -> None:
        """Give a slot back. `content`: what it now holds (True: unchanged, None: unknown). `used` False: it
        served no request (an idle save), so it keeps its place in the least-recently-used order."""
        if not slot.busy:
            return
        if self.trace is not None:
            self.trace.append((slot.name, time.time(), "give"))
        slot.busy = False
        self._filling_over(slot)
        if slot.on_release is not None:
            slot.on_release.set()
            slot.on_release = None
        slot.pending = None
        slot.phase, slot.free_at = "", None
        slot.stream, slot.sent_at, slot.first_token_at, slot.computing = False, None, None, 0
        slot.answer_tokens = None
        if used:
            slot.last_used = time.monotonic()
        if content is not True:
            slot.content = content if isinstance(content, Content) else None
        if self.claims is not None:
            self.claims.released(slot)
        self.wake()

    async def until_released(self, slot: Slot, timeout: float) -> bool:
        """Wait until the busy `slot` is given back (`release`), `timeout` seconds at most; whether it was."""
        if not slot.busy:
            return True
        if slot.on_release is None:
            slot.on_release = asyncio.Event()
        released = slot.on_release
        try:
            async with asyncio.timeout(timeout):
                await released.wait()
        except TimeoutError:
            return False
        return True

    async def take_idle(self, slot: Slot, force: bool = False) -> bool:
        """Take this slot for lpcache's own work (an idle save) when it is idle and no request waits for a slot
        (`force`: even then, for a save that cannot wait), and, with `claims`, no other replica holds it."""
        if slot.taken or (self._waiters and not force):
            return False
        slot.busy = True
        if self.claims is not None:
            try:
                ours = await self.claims.claim(slot)
            except BaseException:
                self._unclaimed(slot)
                raise
            if not ours:
                self._unclaimed(slot)
                return False
        if self.trace is not None:
            self.trace.append((slot.name, time.time(), "take"))
        return True

    def _take(self, choice: Choice) -> Choice:
        choice.slot.busy = True
        choice.slot.used = True
        self._filling_over(choice.slot)
        choice.slot.filling = asyncio.Event()
        return choice

    def wake(self) -> None:
        """Hand idle slots to the waiters, in arrival order; a waiter none of whose allowed slots is idle keeps
        its place without holding up the ones behind it."""
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            idle = self.idle(waiter.want.allowed)
            if not idle:
                if not self.idle():
                    break
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(self._take(waiter.want.choose(idle, self.load())))

    def handed_over(self, slot: Slot) -> None:
        """The slot's new holder saved what it held before (or found it not worth keeping): the slot is that
        request's now. A request that waited for the slot waits for any from then on, in its place in the line; one
        that needs the cache it held (`filling`) finds it on disk. Not at the hand-over itself: a waiter that took
        another slot then would look for a file not written yet. The waits end on the loop's next turn: after the
        bookkeeping the save spawned (`Pipeline.spawn`) put the file's entry in the index."""
        if slot.on_handover:
            loop = asyncio.get_running_loop()
            for widen in list(slot.on_handover):
                loop.call_soon(widen)
        self._filling_over(slot)

    @staticmethod
    def _filling_over(slot: Slot) -> None:
        if slot.filling is not None:
            slot.filling.set()
            slot.filling = None


class Lease:
    """A slot held for one request's try, given back exactly once: by whoever it was handed to, or, used as
    `async with`, when anything is raised inside (a cancellation included), with `on_error` as what the slot then
    holds (None: unknown). `keep()` inside the block: the holder gives it back later, even if something is raised."""

    def __init__(self, pool: SlotPool, choice: Choice, on_error: Content | None | bool = None) -> None:
        self.pool = pool
        self.choice = choice
        self.on_error = on_error
        self.kept = False
        self.returned = False

    @property
    def slot(self) -> Slot:
        return self.choice.slot

    def keep(self) -> None:
        self.kept = True

    def give_back(self, content: Content | None | bool = True, used: bool = True) -> None:
        if not self.returned:
            self.returned = True
            self.pool.release(self.choice.slot, content, used)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None and not self.kept:
            self.give_back(self.on_error)
