"""Hands slots out to requests.

A slot is used by one request at a time (its lock is the `busy` flag, changed only on the event loop). A request
that finds no idle slot waits in a FIFO queue for any slot, not for one in particular, so no request queues behind
a busy slot while another is idle. With REDIS_URL, a slot is claimed across replicas before use (`Claims`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from lpcache.backends.admission import CLASSES, RESERVE_MAX, HoldTimes, Reserved, kept_free
from lpcache.backends.placement import Choice, WaitPlan, Want
from lpcache.backends.slots import Content, Slot
from lpcache.errors import QueueFull, SlotsBusy


@dataclass(eq=False)
class _Waiter:
    want: Want
    deadline: float = math.inf   # when it gives up (monotonic)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Refused(Exception):
    """The slot chosen is another replica's (its claim was refused): the caller plans its wait again."""


class Claims(Protocol):
    """Slot leases across replicas (`fleet.replica.Fleet`, with REDIS_URL): a slot the pool hands out locally is claimed
    before use; another replica's live lease on it makes the pool choose again."""

    async def claim(self, slot: Slot, want: Want | None = None, restore: str | None = None,
                    writes: Content | None = None) -> bool: ...

    def released(self, slot: Slot) -> None: ...

    def valid(self, slot: Slot) -> bool: ...

    def saving(self, slot: Slot) -> None: ...


class SlotPool:
    """Hands out slots: at once when one is idle and nobody waits, else in arrival order as slots come free."""

    def __init__(self, slots: Sequence[Slot], wait_timeout: float = 300.0, queue_max: int = 0) -> None:
        self.slots = list(slots)
        self.wait_timeout = wait_timeout
        self.queue_max = queue_max            # waiters at most (0: no bound): `admission`
        self.hold = HoldTimes()               # how long a request keeps its slot, to predict a wait
        self.refused: Counter[str] = Counter()   # requests refused before waiting, by reason
        self.waits: dict[str, deque[float]] = {c: deque(maxlen=256) for c in CLASSES}   # the last waits, by class
        self._seq = 0
        self._waiters: deque[_Waiter] = deque()
        self.kept: dict[str | None, Reserved] = {}   # shares kept for clients whose last slot came free
        self._reopen: asyncio.TimerHandle | None = None   # wakes the line when the first kept share runs out
        self.claims: Claims | None = None   # set with REDIS_URL
        # `flow.unpinned`: a backend switching between pinned and unpinned requests hands out no slot (`closed`);
        # one whose requests go unpinned gets no slot action of lpcache's own (`unpinned`); told of each release
        self.closed: Callable[[int], bool] = lambda backend: False
        self.unpinned: Callable[[int], bool] = lambda backend: False
        self.released_hook: Callable[[int], None] = lambda backend: None
        self.generating: Counter[str | None] = Counter()   # per client: unpinned requests past their first token
        # When a list (tests): (slot name, wall-clock time, "take" or "give") as this replica starts and stops
        # using a slot; with `claims`, "take" once the slot is claimed.
        self.trace: list[tuple[str, float, str]] | None = None

    def idle(self, allowed: Callable[[Slot], bool] | None = None) -> list[Slot]:
        return [s for s in self.slots if not s.taken and not self.closed(s.backend) and (allowed is None or allowed(s))]

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

    def waiting_by_class(self) -> Counter[str]:
        return Counter(CLASSES[w.want.ticket.priority] for w in self._waiters if not w.future.done())

    def waited(self, want: Want, seconds: float) -> None:
        """A request got its slot (or gave up) after `seconds` in line: kept for the dashboard's figures."""
        self.waits[CLASSES[want.ticket.priority]].append(seconds)

    def line(self) -> dict[str, dict[str, float | int]]:
        """Per priority class: requests waiting now, and the median and longest of its last waits (seconds)."""
        waiting = self.waiting_by_class()
        out: dict[str, dict[str, float | int]] = {}
        for level in CLASSES:
            last = sorted(self.waits[level])
            out[level] = {"waiting": waiting[level], "waits": len(last),
                          "wait_p50": last[len(last) // 2] if last else 0.0, "wait_max": last[-1] if last else 0.0}
        return out

    def holding(self) -> Counter[str | None]:
        """Slots each client's requests hold now (`admission`: fair shares), with the unpinned ones that gave their
        slot back at their first token and still generate in the server (`generating`)."""
        return Counter(s.client for s in self.slots if s.busy and s.taken_at) + self.generating

    def _in_line(self) -> list[_Waiter]:
        """The waiters in the order a free slot goes to them: class, the slots their client holds, arrival."""
        holding = self.holding()
        return sorted(self._waiters, key=lambda w: w.want.ticket.rank(holding))

    def _clients_now(self) -> tuple[Counter[str | None], set[str | None]]:
        """The slots each client holds, and the clients with a request in line."""
        return self.holding(), {w.want.ticket.client for w in self._waiters if not w.future.done()}

    def _free(self, want: Want, idle: list[Slot], deadline: float = math.inf,
              line: tuple[Counter[str | None], set[str | None]] | None = None) -> tuple[list[Slot], float | None]:
        """The `idle` slots `want` may take now, leaving those kept for other clients (`admission.kept_free`);
        when none, also when the first share it must leave runs out. `deadline`: when the request gives up;
        `line`: the slots each client holds and the clients in line, when known."""
        if not self.kept or not idle:
            return idle, None
        holding, waiting = line or self._clients_now()
        now = time.monotonic()
        spare, until = kept_free(want.ticket, [s.backend for s in idle], holding, waiting, self.kept, now,
                                 deadline - now)
        return (idle if spare is None else [s for s in idle if s.backend in spare]), until

    def _keep_share(self, slot: Slot) -> None:
        """`slot`'s client gave it back: if that was its last one, keep a share for it for one mean hold time."""
        now = time.monotonic()
        self.kept = {c: r for c, r in self.kept.items() if r.until > now}
        if self.hold.mean is None or any(s.client == slot.client for s in self.slots
                                         if s is not slot and s.busy and s.taken_at):
            return
        self.kept[slot.client] = Reserved(now + min(self.hold.mean, RESERVE_MAX), slot.backend, slot.priority)

    def admit(self, want: Want, timeout: float) -> None:
        """Refuse, before it waits, a request the line cannot serve in time (`admission`): QUEUE_MAX waiters
        already (429), or a predicted wait past its deadline `timeout` (503); both say when to come back."""
        allowed = [s for s in self.slots if want.allowed is None or want.allowed(s)]
        holding = self.holding()
        mine = want.ticket.rank(holding)
        ahead = sum(1 for w in self._waiters if not w.future.done() and w.want.ticket.rank(holding) <= mine)
        predicted = self.hold.wait(ahead, len(allowed))
        if self.queue_max and len(self._waiters) >= self.queue_max:
            self.refused["queue_full"] += 1
            raise QueueFull(f"{len(self._waiters)} requests wait for a slot already (QUEUE_MAX)",
                            code="queue_full", retry_after=predicted or self.hold.mean or 1.0)
        if predicted is not None and predicted > timeout:
            self.refused["past_deadline"] += 1
            raise SlotsBusy(f"all slots busy: the wait for one ({predicted:.1f} s predicted, {ahead} requests "
                            f"ahead) would pass this request's {timeout:g} s", code="wait_past_deadline",
                            retry_after=predicted)

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
        corrected = False
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
                # what to do with this slot, now that it is ours ...
                want.given_back(choice)
                again = want.choose([choice.slot], self.load())
                if corrected or self._waiters or again.reused >= choice.reused:
                    return self._traced(again), planned
                # ... or, when it was chosen for a cache it turns out not to hold (and cannot restore) and nobody
                # waits (the slot given back would go to the line), once more among all slots, now that this one
                # is known (kept a moment for this replica: `Claims.released`)
                want.given_back(again)
                corrected = True
                choice.slot.taken_at = 0.0   # no hold: it served nothing
                self.release(choice.slot, True, used=False)
                continue
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
        slot.client, slot.taken_at = None, 0.0
        self._filling_over(slot)
        self.wake()

    async def _acquire(self, want: Want, timeout: float, plan: WaitPlan | None) -> tuple[Choice, bool]:
        """Wait in line for a slot `want` allows; with a `plan`, only for the slots it names until its time is up
        (`plan.seconds`, decided again at the awaited slot's progress, never beyond the first), then for any: the
        waiter widens where it stands in the line. Returns the choice and whether it came while the plan held."""
        narrow = want.only(plan.wanted) if plan is not None else want
        deadline = time.monotonic() + timeout
        free, _ = self._free(narrow, self.idle(narrow.allowed), deadline)
        if free and not self._waiters:
            return self._take(narrow.choose(free, self.load()), want), plan is not None
        self._seq += 1
        if want.ticket.seq == 0:   # its place in line (kept when it queues again: `Refused`)
            want.ticket = replace(want.ticket, seq=self._seq)
            narrow.ticket = want.ticket
        if not self._free(want, self.idle(want.allowed), deadline)[0]:
            self.admit(want, timeout)   # (a request planning on a busy slot while another is free is not refused)
        waiter = _Waiter(narrow, deadline)
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
                raise SlotsBusy("all slots busy", code="all_slots_busy",
                                retry_after=self.hold.mean or 1.0) from None
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

    def release(self, slot: Slot, content: Content | None | bool = True, used: bool = True, hold: bool = True) -> None:
        """Give a slot back. `content`: what it now holds (True: unchanged, None: unknown). `used` False: it
        served no request (an idle save), so it keeps its place in the least-recently-used order. `hold` False: its
        request goes on (unpinned, at its first token): not a hold time, and no share kept for its client."""
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
        if slot.taken_at and hold:
            self.hold.add(time.monotonic() - slot.taken_at)
            self._keep_share(slot)
        slot.client, slot.taken_at = None, 0.0
        if used:
            slot.last_used = time.monotonic()
        if content is not True:
            slot.content = content if isinstance(content, Content) else None
        if self.claims is not None:
            self.claims.released(slot)
        self.released_hook(slot.backend)
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

    async def take_idle(self, slot: Slot, force: bool = False, writes: Content | None = None) -> bool:
        """Take this slot for lpcache's own work (an idle save) when it is idle and no request waits for a slot
        (`force`: even then, for a save that cannot wait), and, with `claims`, no other replica holds it (the others
        are told the cache it `writes`: their limits keep that file while it is written)."""
        if slot.taken or (self._waiters and not force) or self.closed(slot.backend) or self.unpinned(slot.backend):
            return False
        slot.busy = True
        if self.claims is not None:
            try:
                ours = await self.claims.claim(slot, writes=writes)
            except BaseException:
                self._unclaimed(slot)
                raise
            if not ours:
                self._unclaimed(slot)
                return False
        if self.trace is not None:
            self.trace.append((slot.name, time.time(), "take"))
        return True

    def _take(self, choice: Choice, want: Want) -> Choice:
        choice.slot.busy = True
        choice.slot.used = True
        choice.slot.client, choice.slot.taken_at = want.ticket.client, time.monotonic()
        choice.slot.priority = want.ticket.priority
        self._filling_over(choice.slot)
        choice.slot.filling = asyncio.Event()
        return choice

    def wake(self) -> None:
        """Hand idle slots to the waiters, in the line's order (`admission`: class, fair shares, arrival); a waiter
        none of whose allowed slots is idle, or that must leave them to a share kept for another client, keeps its
        place without holding up the ones behind it."""
        handed, reopen = True, None
        while handed:   # the line's order again after each hand-out: the slots each client holds changed
            handed = False
            line, held = self._clients_now(), [set[Slot]() for _ in CLASSES]
            for waiter in self._in_line():
                if waiter.future.done():
                    self._waiters.remove(waiter)
                    continue
                idle = self.idle(waiter.want.allowed)
                if not idle:
                    if not self.idle():
                        return
                    continue
                level = waiter.want.ticket.priority   # never ahead of a higher class held back, on its slots
                free, until = self._free(waiter.want, [s for s in idle if not any(s in h for h in held[:level])],
                                         waiter.deadline, line)
                if not free:
                    if until is not None:
                        reopen = until if reopen is None else min(reopen, until)
                        held[level].update(idle)
                    continue
                self._waiters.remove(waiter)
                waiter.future.set_result(self._take(waiter.want.choose(free, self.load()), waiter.want))
                handed = True
                break
        if reopen is not None:
            self._wake_at(reopen)

    def _wake_at(self, when: float) -> None:
        """Run `wake` again at `when` (monotonic seconds): a kept share runs out with nobody releasing a slot."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # no loop: nobody can be waiting
            return
        if self._reopen is not None:
            self._reopen.cancel()
        self._reopen = loop.call_later(max(when - time.monotonic(), 0.0) + 0.001, self.wake)

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

    def give_back(self, content: Content | None | bool = True, used: bool = True, hold: bool = True) -> None:
        if not self.returned:
            self.returned = True
            self.pool.release(self.choice.slot, content, used, hold)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None and not self.kept:
            self.give_back(self.on_error)
