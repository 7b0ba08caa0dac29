"""Which slot a request gets, and how long it may wait for a busy one.

The choice is a pure function of the idle slots, the prompt and the best saved cache (`choose`), so it is tested
without a server; a wait for a busy slot is planned against the prefill it spares (`wait_plan`, `beside_wait`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from lpcache.backends.admission import Ticket
from lpcache.backends.slots import Content, Slot
from lpcache.cache.meta_files import Candidate
from lpcache.cache.prefix import Prompt, common_prefix
from lpcache.cache.speeds import Speeds


@dataclass(frozen=True, slots=True)
class Choice:
    """The slot a request gets, and the saved cache to restore into it first (None: use what it holds)."""

    slot: Slot
    restore: Candidate | None = None
    resident: int = 0       # identity blocks of the prompt the slot already holds
    skipped: bool = False   # a saved cache held more, but restoring it would take longer than the prefill
    warm: bool = False      # taken because the server's RAM prompt cache likely holds the prompt ...
    warm_blocks: int = 0    # ... this many of its identity blocks
    seed: bool = False      # a session starting anew, placed as in prefix mode (`SlotFiller.take_slot`)

    @property
    def reused(self) -> int:
        """Identity blocks of the prompt this choice gives without computing them: held, or restored."""
        return max(self.resident, self.restore.shared if self.restore is not None else 0)

    @property
    def uncomputed(self) -> int:
        """Identity blocks of the prompt the server likely does not compute: those reused, or those its RAM prompt
        cache likely gives back (`warm`). What is left is the prefill its request still has (`Slot.computing`)."""
        return max(self.reused, self.warm_blocks if self.warm else 0)


Pays = Callable[[Slot, Candidate, int], bool]


def choose(idle: Sequence[Slot], prompt: Prompt | None, candidate: Candidate | None,
           session: str | None = None, homes: frozenset[int] = frozenset(), pays: Pays | None = None,
           warm: tuple[int, int, bool] | None = None, kept: Callable[[str], bool] | None = None,
           load: Mapping[int, int] | None = None, mine: Callable[[Slot], bool] | None = None) -> Choice:
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
    `mine`: the slots whose cache the request may be placed on for what they hold (a session starting anew: not
    another client key's session).
    """
    if session is not None:
        for slot in idle:
            if slot.content is not None and slot.content.key == session:
                return Choice(slot, None, len(slot.content.chain))
        at_home = [s for s in idle if s.backend in homes]
        return Choice(_coldest(at_home or idle, load), None, 0)
    best_slot, best_shared = resident(idle if mine is None else [s for s in idle if mine(s)], prompt)
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
    least = min(there, key=lambda s: (common_prefix(s.content.chain, prompt.exact) if s.content else 0,
                                      s.last_used, s.id))
    if least.content is not None and warm[1] < common_prefix(least.content.chain, prompt.exact) + 2:
        # every idle slot there shares about what the RAM likely holds (a system prompt all prompts start with,
        # under the share `resident` counts): the RAM would give nothing the slot does not, and its outcome
        # would read as a miss
        return None
    return least


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
              budget: Budget, mine: Callable[[Slot], bool] | None = None) -> WaitPlan | None:
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
        at_home = [s for s in slots if ok(s) and s.backend in homes]
        if homes and at_home and all(s.taken for s in at_home):
            seconds = budget(_soonest(at_home), n, False)
            return WaitPlan(lambda s: s.backend in homes, seconds) if seconds > 0 else None
        return None
    if prompt is None or not prompt.exact:
        return None
    best: Slot | None = None
    busy_shared, idle_shared = 0, 0
    idle_backends = {s.backend for s in slots if ok(s) and not s.taken}
    for slot in slots:
        if not ok(slot):
            continue
        taken = slot.taken
        held = (slot.pending or slot.content) if taken else slot.content
        shared = common_prefix(held.chain, prompt.exact) if held is not None else 0
        # one request waits for a slot, not several; unless the only idle slots are on its server, where a prefill
        # would run beside it (several agents of one harness started together: each waits out its prefill, then
        # one takes the slot, the others restore the file its cache is saved to)
        if mine is not None and not mine(slot):
            continue   # another client key's session: not waited for, nor counted as what an idle slot holds
        if taken and shared > busy_shared and (not slot.awaited or idle_backends == {slot.backend}):
            best, busy_shared = slot, shared
        elif not taken:
            idle_shared = max(idle_shared, shared)
    disk = candidate.shared if candidate is not None else 0
    least = max(1, math.ceil(RESIDENT_MIN_SHARE * len(prompt.exact)))
    if best is not None and busy_shared >= least and busy_shared > max(idle_shared, disk):
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
    # the server whose RAM likely holds it, weighed against the best saved file (`choose`'s candidate)
    warm: Callable[[Candidate | None], tuple[int, int, bool] | None] | None = None
    kept: Callable[[str], bool] | None = None        # whether a cache's file is on disk
    mine: Callable[[Slot], bool] | None = None       # slots whose cache it may use (`choose`)
    answer_tokens: int | None = None                 # the request's max_tokens, when it says
    seed: bool = False   # a new session's first turn: its slot is chosen as in prefix mode (`SlotFiller.take_slot`)
    ticket: Ticket = field(default_factory=Ticket)   # its client and class in the line (`admission`)
    max_wait: float | None = None                    # the longest it may wait (None: SLOT_WAIT_TIMEOUT)
    file_of: Callable[[Slot], str] | None = None     # the name its prefix cache is saved under from a slot

    def choose(self, idle: Sequence[Slot], load: Mapping[int, int] | None = None) -> Choice:
        candidate = self.lookup()
        choice = choose(idle, self.prompt, candidate, None if self.seed else self.session, self.homes, self.pays,
                        self.warm(candidate) if self.warm is not None else None, self.kept, load, self.mine)
        if choice.restore is not None and self.protect is not None:
            self.protect(choice.restore.entry.key)   # on the event loop, before anything else can prune it
        return choice

    def given_back(self, choice: Choice) -> None:
        if choice.restore is not None and self.unprotect is not None:
            self.unprotect(choice.restore.entry.key)

    def pending(self, slot: Slot | None = None) -> Content | None:
        """What the request will leave in `slot` (told to the other replicas when it claims the slot), under the
        name its file will have: a session's, or the prefix cache's for that slot's model (`file_of`)."""
        if self.prompt is None:
            return None
        key = self.session or (self.file_of(slot) if self.file_of is not None and slot is not None
                               else self.prompt.key)
        return Content(key, self.prompt.exact, session=self.session)

    def only(self, wanted: Callable[[Slot], bool]) -> Want:
        allowed = self.allowed
        return replace(self, allowed=wanted if allowed is None else (lambda s: allowed(s) and wanted(s)))


DECODE_PER_PREFILL = 32   # prefilled tokens one decoded token costs at most, before any speed is learnt


def beside_wait(slot: Slot, mine: float, blocks: int, speeds: Speeds) -> float:
    """How long to wait for a busy slot on the one server a request could otherwise prefill on (`beside` it),
    when the busy slot's prompt shares `blocks` identity blocks with the request's (`mine` tokens in all).

    Two prefills on one server share its compute: going now finishes the request's prefill when both are done
    (about `mine` + what the busy slot still computes, counted twice where they overlap); waiting finishes it after
    the busy slot's prefill, its answer and save, then the request's own part. So:
    - while the busy slot still prefills (no first token yet): wait only if what it has left to compute is less than
      the request's tokens plus the shared ones (in tokens: no speed needed); for a stream, until its first token,
      when the wait is decided again (`SlotPool.progressed`); for a JSON answer, only at learnt speeds;
    - once its first token came: its prefill is over, and waiting beats prefilling only while the wait stays under
      the prefill of the shared part (at the learnt speed, else as measured on the busy slot's own prefill).
    """
    now = time.monotonic()
    shared = speeds.tokens_of(blocks)
    benefit = speeds.prefill.seconds(shared)
    if slot.first_token_at is not None:
        if benefit is None and slot.sent_at is not None:
            took = slot.first_token_at - slot.sent_at   # its own prefill, of `computing` blocks
            benefit = took * blocks / max(slot.computing, 1)
        return max(0.0, slot.first_token_at + (benefit or 0.0) - now)
    left = speeds.tokens_of(slot.computing)
    per_token = speeds.prefill.seconds(1.0)
    if per_token and slot.sent_at is not None:
        left = max(0.0, left - (now - slot.sent_at) / per_token)
    if left >= mine + shared:
        return 0.0          # its prefill alone outlasts the request's prefill beside it
    if slot.stream:
        return math.inf     # wait out its prefill; decided again at its first token
    if benefit is None or per_token is None:
        # no speed learnt yet (the first requests after a start: agents sent together, all with one harness): a
        # JSON answer's progress is not seen, so waiting pays only when its answer, capped by its max_tokens, is
        # surely shorter to generate than the shared part is to prefill (a decoded token taken to cost
        # DECODE_PER_PREFILL prefilled ones: about so on CPUs, more on GPUs, where the wait is bounded all the same);
        # until it is released, SLOT_AFFINITY_WAIT at most
        capped = slot.answer_tokens is not None and slot.answer_tokens * DECODE_PER_PREFILL < shared
        return math.inf if capped else 0.0
    generate = speeds.generate.seconds(min(slot.answer_tokens or 64, 64))   # its max_tokens, or a short answer
    if generate is None or generate >= benefit:
        return 0.0
    return left * per_token + benefit


def prefill_left(slot: Slot, speeds: Speeds, now: float) -> float:
    """The prefill a busy slot's request still has to compute (`Slot.computing`: what neither the slot nor the server's
    RAM likely holds), in seconds at the learnt speed (0: its first token came, or no speed learnt yet), or what is
    left of a save under way: about the least time it stays busy. Its answer is left out: a max_tokens bounds it,
    but it may end at any token."""
    if not slot.busy:
        return 0.0
    if slot.phase == "save":
        return max(0.0, slot.free_at - now) if slot.free_at is not None else 0.0
    if slot.first_token_at is not None:
        return 0.0
    prefill = speeds.prefill.seconds(speeds.tokens_of(slot.computing))
    if prefill is None:
        return 0.0
    return max(0.0, prefill - (now - slot.sent_at)) if slot.sent_at is not None else prefill


def route_of(choice: Choice, want: Content | None) -> str:
    """Why the request got its slot, for its record: the slot holds its prefix (`resident`), a saved cache is
    restored into it (`restore`), its session's (`session`), the server's RAM cache likely has it (`server_ram`), or
    nothing cached anywhere helps and the least-loaded backend computes it (`prefill`)."""
    if want is not None:
        return "session"
    if choice.restore is not None:
        return "restore"
    if choice.resident:
        return "resident"
    return "server_ram" if choice.warm else "prefill"
