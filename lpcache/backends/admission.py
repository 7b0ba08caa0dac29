"""Who gets the next free slot, and who is told at once that waiting will not do.

llama-server alone serves requests in arrival order, and so did lpcache's line of waiters: a burst of one client's
agents held every slot while another client's interactive request waited behind all of it, and a request learnt it
would not be served only when SLOT_WAIT_TIMEOUT ran out. Now, when requests outnumber slots:

- **Priority classes** (`CLASSES`): a request asks for one with `X-Lpcache-Priority: high|normal|low`, or gets its
  client key's (CLIENT_PRIORITIES); with client keys a request may ask for a lower class than its key's, never a
  higher one. A free slot goes to the highest class waiting: a high-priority request waits for at most one running
  generation to end.
- **Fair shares** within a class: the waiter whose client (its key, or without client keys its Authorization: the
  `guard.client_identity` digest) holds the fewest slots right now goes first, then arrival order. One client's
  burst takes its turn with the others' requests instead of holding every slot; a single client is served in
  arrival order, as before.
- **A share kept for a client that comes back** (`Reserved`): when a client's last slot comes free, one slot of
  that backend stays out of another client's reach for one mean hold time (HoldTimes, at most RESERVE_MAX), unless
  that other client holds no slot itself, asks for a higher class, or would give up before the share ends. An
  agent's next step, sent the moment its answer ends, finds its slot instead of waiting behind another client's
  whole burst; a client that does not come back costs the others at most that one hold time of one slot.
- **Refusals**, before any wait: 429 when QUEUE_MAX requests wait already; 503 when the wait the line predicts (the
  requests ahead, at the slots' recent hold times: `HoldTimes`) passes the request's deadline (SLOT_WAIT_TIMEOUT, or
  less with `X-Lpcache-Max-Wait: SECONDS`). Both carry `Retry-After`. A wait that runs out all the same is a 503
  with `Retry-After` too.

Pure: the pool (`slot_pool`) keeps the line and calls these.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

CLASSES = ("high", "normal", "low")
NORMAL = 1
PRIORITY_HEADER = "x-lpcache-priority"
MAX_WAIT_HEADER = "x-lpcache-max-wait"
HOLD_ALPHA = 0.2     # weight of the newest hold time in the running mean
HOLD_TRUSTED = 8     # hold times seen before a wait is predicted (and a request refused for it)
RESERVE_MAX = 30.0   # seconds a freed share is kept for its client at most


def priority(asked: str | None, allowed: int = NORMAL, keys_held: bool = False) -> int:
    """The class index a request is served at: `asked` (the header, any case) when it names a class, else its
    client key's (`allowed`); with client keys (`keys_held`) never above the key's."""
    wanted = CLASSES.index(asked.strip().lower()) if asked and asked.strip().lower() in CLASSES else allowed
    return max(wanted, allowed) if keys_held else wanted


def max_wait(asked: str | None, limit: float) -> float:
    """The longest a request may wait for a slot: SLOT_WAIT_TIMEOUT (`limit`), or less when it asks (a number of
    seconds, `X-Lpcache-Max-Wait`); anything else is ignored."""
    try:
        seconds = float(asked) if asked is not None else math.inf
    except ValueError:
        return limit
    return min(limit, seconds) if math.isfinite(seconds) and seconds >= 0 else limit


@dataclass(frozen=True)
class Ticket:
    """A request's place in the line: its client's digest (None: anonymous), class index, and arrival number."""

    client: str | None = None
    priority: int = NORMAL
    seq: int = 0

    def rank(self, holding: Mapping[str | None, int]) -> tuple[int, int, int]:
        """Its order in the line now: class, then the slots its client holds, then arrival."""
        return self.priority, holding.get(self.client, 0), self.seq


class HoldTimes:
    """How long a request keeps its slot, as a running mean of the last ones (`HOLD_ALPHA`), to predict a wait."""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.seen = 0

    def add(self, seconds: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            return
        self.seen += 1
        self.mean = seconds if self.mean is None else self.mean + HOLD_ALPHA * (seconds - self.mean)

    def wait(self, ahead: int, slots: int) -> float | None:
        """The wait of a request with `ahead` requests before it in the line, for `slots` slots that each come free
        every `mean` seconds; None until HOLD_TRUSTED hold times are seen (or without slots)."""
        if self.mean is None or self.seen < HOLD_TRUSTED or slots <= 0:
            return None
        return self.mean * (ahead + 1) / slots


@dataclass(frozen=True)
class Reserved:
    """A share kept for a client whose last slot came free (`until`, monotonic seconds), on the backend it used, for
    requests of its class or a lower one (a higher class is not held back for it)."""

    until: float
    backend: int
    priority: int


def kept_free(ticket: Ticket, idle_backends: list[int], holding: Mapping[str | None, int], waiting: set[str | None],
              kept: Mapping[str | None, Reserved], now: float, patience: float) -> tuple[set[int] | None, float | None]:
    """Which of the idle slots (their backends, `idle_backends`: one entry per slot) `ticket`'s client may take now:
    (None, None) any; (backends, None) only those on `backends`, the others' idle slots being kept for other
    clients; (empty, until) none before `until`, when the first share it must leave runs out. A client that holds
    no slot is never held back (it takes its own share); nor for a client that holds one, waits in line (the line's
    order serves it) or asked for a lower class; nor for a share that outlasts the request's `patience` (seconds
    it may still wait: holding it back would only make it time out)."""
    if not holding.get(ticket.client, 0):
        return None, None
    shares = [r for c, r in kept.items()
              if c != ticket.client and now < r.until <= now + patience and not holding.get(c, 0)
              and c not in waiting and r.priority <= ticket.priority and r.backend in idle_backends]
    if not shares:
        return None, None
    needed = Counter(r.backend for r in shares)
    spare = {b for b, n in Counter(idle_backends).items() if n > needed[b]}
    return (spare, None) if spare else (set(), min(r.until for r in shares))
