"""Which saved caches to delete when there are too many (META_MAX) or they take too many bytes: the ones predicted
to be needed furthest in the future, not the least recently used.

Why not LRU. Conversations take turns: a user reads, thinks, types, and the same conversation comes back. When the
conversations in turn are slightly more than the limit (12 in a cycle, limit 10), LRU deletes exactly the one that
comes next, and no conversation ever gets a hit. Belady's optimal policy deletes the entry needed furthest in the
future; here each entry's next use is predicted from its own rhythm, the intervals between its past uses. And a
count of files is the wrong unit (20 MB for a small model at 1k tokens, gigabytes for a 7B model at 8k tokens), so
a byte budget is enforced besides the count.

The rule. Every entry not in `keep` gets a predicted time of next use, and the furthest goes first:

- used at least twice (it has an `interval`, an EWMA of the gaps between its uses): `last_use + interval`, even
  when that time is past (a conversation a little late is expected any moment); but once unused for more than
  ABANDON (2) intervals, its own or the typical one T (below) whichever is longer, it is abandoned: `now + age`,
  its age counting as in LRU (a fast rhythm learnt from a gap or two is not trusted to give up on it sooner);
- used once, when some entry's interval is known (T, the median of the known intervals): abandoned after ABANDON
  typical intervals like the others, and before that `now + T * (1 + h)`, where h in [0, 1) is a fixed hash of the
  key: one to two typical intervals away. So one-off conversations go before any conversation on its rhythm, and
  among themselves in a deterministic random order: ranked by age (LRU) they would again delete exactly the next
  one when a group of them takes turns, and never live to their second use;
- nothing known at all (no entry was ever used twice): by the hash alone (random replacement, for the same reason).

The entries are deleted in that order (ties: key order) until the count is at most `max_count` and the bytes
(sizes of 0 = unknown count as 0) at most `max_bytes` (0 = no limit); a key in `keep` (the entry just saved,
entries a request chose for a restore that has not run yet: LRU was seen to prune one 37 ms before its
restore) is never deleted: when the kept entries alone exceed a limit,
everything else is deleted and that is all. On a cycle slightly larger than the limit this keeps most of the cycle
(the entries just used are predicted furthest away, like MRU); with a few hot conversations and a stream of one-off
ones it keeps the hot ones; a conversation that stops goes first once overdue by a whole interval.

A conversation's next turn is saved as a new file that makes the previous turn's redundant: the new entry takes
over the old one's history (`Usage.inherit`, `UsageTable.add(..., supersedes=...)`), otherwise every file would
look new. The caller notes the request's use on the old entry (`use(t)`, restored or not) before the new save.

Value. A file of a model whose prefill is slow spares more per byte than one of a model whose prefill is quick (or
whose cache weighs more per token): each entry may carry its `worth`, the prefill milliseconds it spares per byte
(`worth.Worth`, from the speeds of the backend that saved it). The time until an entry's predicted use is divided by
its worth relative to the typical one (the median of the recent entries' worths): an entry worth twice as much
counts as needed twice as soon. Entries of equal worth (one model, the common case) keep the order above.

Cost. `victims(entries, ...)` ranks every entry: O(n log n) (the median interval; O(n) for the ranking itself)
plus O(k log n) for k deletions: 50 to 90 ms at 100,000 entries in CPython, too slow for every save. `UsageTable`
keeps the entries in last-use order, their total size, lazy heaps of `last_use + interval` and of the hashes of
the entries used once, and the typical interval as the median of the recent interval estimates; its `victims`
ranks only candidates: the SAMPLE least recently used (abandoned and stale entries), the SAMPLE with the furthest
`last_use + interval` (rhythms just used) and the SAMPLE used once with the highest hash, read from the heaps'
tops in O(SAMPLE log SAMPLE) (at most 8 * SAMPLE items looked at per heap). A heap item made stale by a change is
dropped when it reaches the top, and a heap is rebuilt (O(n)) when it holds twice the entries. Measured
(bench/eviction.py, 100,000 entries, one deletion): about 0.1 ms median, 0.3 ms p99 in CPU time. It makes the
choice `victims` makes whenever the best entries are among the candidates (always when n <= SAMPLE, if the typical
intervals agree); when the candidates are not enough (a byte budget that needs many deletions), it ranks
everything.

Pure: no I/O, no clock (time is passed in, in seconds), no randomness; the same calls give the same answers.
"""

from __future__ import annotations

import heapq
import statistics
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

ALPHA = 0.25  # weight of the newest gap in the interval's EWMA
ABANDON = 2.0  # unused for more than this many intervals (its own or the typical one, the longer): abandoned
SAMPLE = 16  # UsageTable.victims: candidates taken from each of its three orders
TYPICAL_WINDOW = 101  # UsageTable: the typical interval is the median of this many most recent interval estimates


def key_hash(key: str) -> float:
    """A fixed number in [0, 1) for a key (CRC-32: the same in every process, unlike hash())."""
    return zlib.crc32(key.encode()) / 4294967296.0


@dataclass(slots=True)
class Usage:
    """How a saved cache has been used: `size` in bytes (0 = unknown), the time of its last use, the EWMA of the
    intervals between its uses (None until it was used twice) and the number of uses (its save counts as one)."""

    key: str
    size: int = 0
    last_use: float = 0.0
    interval: float | None = None
    uses: int = 1
    worth: float = 0.0   # prefill ms the file spares per byte (0: unknown, counted as the typical worth)

    def use(self, t: float, alpha: float = ALPHA) -> None:
        """A use at time `t` (a restore, or a request that continued it without one). A use at or before the last
        one counts but adds no interval."""
        gap = t - self.last_use
        if gap > 0:
            self.interval = gap if self.interval is None else alpha * gap + (1.0 - alpha) * self.interval
            self.last_use = t
        self.uses += 1

    def inherit(self, old: Usage) -> None:
        """This entry supersedes `old` (the same conversation, a turn later): it takes over old's rhythm. The
        request's use is expected to have been noted on `old` already; the save itself adds none."""
        if old.interval is not None and (self.interval is None or old.uses >= self.uses):
            self.interval = old.interval
        self.worth = self.worth or old.worth
        self.uses = max(self.uses, old.uses)
        self.last_use = max(self.last_use, old.last_use)

    def predicted(self, now: float, typical: float | None) -> float:
        """The predicted time of the next use (the module's rule); `typical`: the typical interval, None when no
        entry has one (then the result is only a rank: the key's hash)."""
        age = max(0.0, now - self.last_use)
        if self.interval is not None:
            if age > ABANDON * (self.interval if typical is None else max(self.interval, typical)):
                return now + age
            return self.last_use + self.interval
        if typical is None:
            return key_hash(self.key)
        if age > ABANDON * typical:
            return now + age
        return now + typical * (1.0 + key_hash(self.key))


def ranked(usage: Usage, now: float, typical: float | None, worth: float | None) -> float:
    """The predicted next use, brought nearer for an entry worth more per byte than the typical one (`worth`), put
    further for one worth less."""
    predicted = usage.predicted(now, typical)
    if typical is None or not worth or not usage.worth or usage.worth == worth:
        return predicted
    return now + (predicted - now) * worth / usage.worth


def typical_worth(entries: Iterable[Usage]) -> float | None:
    known = [u.worth for u in entries if u.worth > 0]
    return statistics.median(known) if known else None


def typical_interval(entries: Iterable[Usage]) -> float | None:
    """The median of the known intervals, None when no entry has one."""
    known = [u.interval for u in entries if u.interval is not None]
    return statistics.median(known) if known else None


def victims(entries: Iterable[Usage], now: float, max_count: int, max_bytes: int,
            keep: Collection[str] = ()) -> list[str]:
    """The keys to delete, furthest predicted use first, so that at most `max_count` entries and `max_bytes` bytes
    remain (0 = no limit); never a key in `keep`. Ranks every entry: O(n log n) (UsageTable.victims is cheap)."""
    entries = list(entries)
    return _victims(entries, now, max_count, max_bytes, keep, typical_interval(entries), typical_worth(entries))


def lru_victims(entries: Iterable[Usage], now: float, max_count: int, max_bytes: int,
                keep: Collection[str] = ()) -> list[str]:
    """LRU, for comparison: the least recently used first (ties: key order), same limits and `keep`; `now` is
    unused."""
    entries = list(entries)
    count, total = len(entries), sum(u.size for u in entries)
    return _select(entries, lambda u: (u.last_use, u.key), count, total, max_count, max_bytes, keep)


def _victims(entries: Iterable[Usage], now: float, max_count: int, max_bytes: int, keep: Collection[str],
             typical: float | None, worth: float | None = None, count: int | None = None,
             total: int | None = None) -> list[str]:
    entries = list(entries)
    count = len(entries) if count is None else count
    total = sum(u.size for u in entries) if total is None else total
    return _select(entries, lambda u: (-ranked(u, now, typical, worth), u.key), count, total, max_count, max_bytes,
                   keep)


def _over(count: int, total: int, max_count: int, max_bytes: int) -> bool:
    return (max_count > 0 and count > max_count) or (max_bytes > 0 and total > max_bytes)


def _as_set(keep: Collection[str]) -> Collection[str]:
    return keep if isinstance(keep, set | frozenset | dict) else set(keep)


def _select(candidates: Iterable[Usage], rank: Callable[[Usage], tuple[float, str]], count: int, total: int,
            max_count: int, max_bytes: int, keep: Collection[str]) -> list[str]:
    """Take candidates in `rank` order (smallest first) until the limits hold, given the count and bytes of all
    the entries (candidates or not)."""
    if not _over(count, total, max_count, max_bytes):
        return []
    keep = _as_set(keep)
    heap = [(rank(u), u.size) for u in candidates if u.key not in keep]
    heapq.heapify(heap)
    chosen = []
    while heap and _over(count, total, max_count, max_bytes):
        (_, key), size = heapq.heappop(heap)
        chosen.append(key)
        count -= 1
        total -= size
    return chosen


class UsageTable:
    """The usage records of an index's entries, kept so that `victims` is cheap at 100,000 entries: last-use order
    (oldest first), total bytes, lazy heaps of `last_use + interval` and of the hashes of entries used once, and
    the typical interval (the median of the TYPICAL_WINDOW most recent interval estimates). It only answers; the
    caller deletes the files and calls `remove`."""

    def __init__(self, sample: int = SAMPLE, alpha: float = ALPHA) -> None:
        self.sample = sample
        self.alpha = alpha
        self.total_bytes = 0
        self._entries: OrderedDict[str, Usage] = OrderedDict()  # least recently used first
        self._due: list[tuple[float, str]] = []  # (-(last_use + interval), key); stale items dropped when met
        self._once: list[tuple[float, str]] = []  # (-key_hash(key), key) of entries without an interval
        self._recent: deque[float] = deque(maxlen=TYPICAL_WINDOW)
        self._worths: deque[float] = deque(maxlen=TYPICAL_WINDOW)   # the recent entries' worths (the typical one)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Usage]:
        """The records, least recently used first (a snapshot)."""
        return iter(list(self._entries.values()))

    def get(self, key: str) -> Usage | None:
        return self._entries.get(key)

    def typical(self) -> float | None:
        return statistics.median(self._recent) if self._recent else None

    def typical_worth(self) -> float | None:
        return statistics.median(self._worths) if self._worths else None

    def add(self, key: str, size: int, t: float, supersedes: Iterable[str] = (),
            history: Iterable[Usage] = (), worth: float = 0.0) -> Usage:
        """A cache saved at `t`, sparing `worth` ms of prefill per byte (0: unknown); it takes over the history of
        the entries it makes redundant (and of an earlier save under the same key), which leave the table, and of
        `history` (records of entries deleted earlier whose conversation it continues)."""
        usage = Usage(key, max(0, size), t, worth=max(0.0, worth))
        if usage.worth:
            self._worths.append(usage.worth)
        for past in history:
            usage.inherit(past)
        for old_key in (key, *supersedes):
            old = self.remove(old_key)
            if old is not None:
                usage.inherit(old)
        return self._enter(usage)

    def load(self, key: str, size: int, last_use: float, interval: float | None, uses: int) -> Usage:
        """An entry read back at start, with the history its meta file kept."""
        self.remove(key)
        return self._enter(Usage(key, max(0, size), last_use, interval, max(1, uses)))

    def _enter(self, usage: Usage) -> Usage:
        self._entries[usage.key] = usage
        self.total_bytes += usage.size
        if usage.interval is None:
            heapq.heappush(self._once, (-key_hash(usage.key), usage.key))
        self._changed(usage)
        return usage

    def use(self, key: str, t: float) -> None:
        """A use of `key` at `t` (a restore, or a request that continued it without one)."""
        usage = self._entries.get(key)
        if usage is None:
            return
        due = None if usage.interval is None else usage.last_use + usage.interval
        usage.use(t, self.alpha)
        self._entries.move_to_end(key)
        if usage.interval is not None and usage.last_use + usage.interval != due:
            self._changed(usage)

    def remove(self, key: str) -> Usage | None:
        usage = self._entries.pop(key, None)
        if usage is not None:
            self.total_bytes -= usage.size
        return usage

    def victims(self, now: float, max_count: int, max_bytes: int, keep: Collection[str] = ()) -> list[str]:
        """The keys to delete, by the module's rule, ranking only the candidates (see the module's Cost)."""
        count, total = len(self._entries), self.total_bytes
        if not _over(count, total, max_count, max_bytes):
            return []
        keep = _as_set(keep)
        typical = self.typical()
        candidates: dict[str, Usage] = {}
        every = True   # every entry not kept is a candidate
        for key, usage in self._entries.items():
            if len(candidates) >= self.sample:
                every = False
                break
            if key not in keep:
                candidates[key] = usage
        if every:   # the heaps' tops can add none: only their stale roots go, as `_top` drops them
            self._drop_stale(self._due, self._is_due)
            self._drop_stale(self._once, self._is_once)
        else:
            for usage in self._top(self._due, self._is_due, keep):
                candidates.setdefault(usage.key, usage)
            for usage in self._top(self._once, self._is_once, keep):
                candidates.setdefault(usage.key, usage)
        worth = self.typical_worth()
        chosen = _victims(candidates.values(), now, max_count, max_bytes, keep, typical, worth, count, total)
        if len(chosen) == len(candidates) < count:
            freed = sum(candidates[k].size for k in chosen)
            if _over(count - len(chosen), total - freed, max_count, max_bytes):  # not enough: rank everything
                chosen = _victims(self._entries.values(), now, max_count, max_bytes, keep, typical, worth, count,
                                  total)
        return chosen

    def _changed(self, usage: Usage) -> None:
        if usage.interval is not None:
            self._recent.append(usage.interval)
            heapq.heappush(self._due, (-(usage.last_use + usage.interval), usage.key))
        bound = 2 * len(self._entries) + 1024  # stale items: rebuilt in O(n) after at least n changes
        if len(self._due) > bound:
            self._due = [(-(u.last_use + u.interval), u.key) for u in self._entries.values() if u.interval is not None]
            heapq.heapify(self._due)
        if len(self._once) > bound:
            self._once = [(-key_hash(u.key), u.key) for u in self._entries.values() if u.interval is None]
            heapq.heapify(self._once)

    def _is_due(self, item: tuple[float, str]) -> Usage | None:
        usage = self._entries.get(item[1])
        if usage is None or usage.interval is None or -(usage.last_use + usage.interval) != item[0]:
            return None
        return usage

    def _is_once(self, item: tuple[float, str]) -> Usage | None:
        usage = self._entries.get(item[1])
        return usage if usage is not None and usage.interval is None else None

    @staticmethod
    def _drop_stale(heap: list[tuple[float, str]], current: Callable[[tuple[float, str]], Usage | None]) -> None:
        """The stale items at the root of a lazy heap go."""
        while heap and current(heap[0]) is None:
            heapq.heappop(heap)

    def _top(self, heap: list[tuple[float, str]], current: Callable[[tuple[float, str]], Usage | None],
             keep: Collection[str]) -> list[Usage]:
        """Up to SAMPLE current entries not kept from the top of a lazy heap: stale items at the root are dropped,
        then the heap is walked from the root, read-only, in order (a small heap of frontier positions), at most
        8 * SAMPLE items: O(SAMPLE log SAMPLE)."""
        self._drop_stale(heap, current)
        found: list[Usage] = []
        seen: set[str] = set()
        frontier = [(heap[0], 0)] if heap else []
        size, visits = len(heap), 8 * self.sample
        while frontier and len(found) < self.sample and visits > 0:
            visits -= 1
            item, i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
            usage = current(item)
            if usage is not None and item[1] not in seen and item[1] not in keep:
                seen.add(item[1])
                found.append(usage)
        return found
