"""Where a prompt is likely still in a server's own RAM prompt cache (`--cache-ram`, on by default).

llama-server copies a slot's cache into RAM whenever a request replaces it (a pinned request to a slot holding
something else makes it look there too), so a conversation lpcache sent to one server is likely still in that
server's RAM after its slot was reused, and in no other server's. When no slot holds a prompt and no saved file
of it is left, sending it to that server, in a slot that holds something (an empty pinned slot skips the RAM
cache), lets the server find it; any other server computes it all. This remembers, per identity-chain digest,
the last server whose slot held it: the deepest digest of a prompt found here names that server. With it, how many
blocks of prompts that server's slots held after it (`since`): what its RAM kept beside the prompt, when it serves it
again (entries leave oldest first).

A guess, never a claim: it only steers a request that would otherwise go to any slot, and is never reported as a
hit. Bounded: the oldest digests are forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence

LIMIT = 200_000   # digests remembered (about 30 MB)
HOLDS_KEPT = 256   # the latest prompts a server's slots held, remembered per server (`since`)
LOST_KEPT = 16    # caches a restore took out of a server's RAM reach, remembered per server (`lost`), newest kept
LOST_SECONDS = 600.0   # ... for this long: a conversation quiet longer is not worth a restore at a switch
RAM_WINDOW = 32              # the last requests left to a server's RAM cache, whose outcomes are weighed
RAM_RETRY_SECONDS = 600.0    # outcomes older than this are forgotten: the server may have been restarted otherwise
RAM_HIT_SHARE = 0.5          # cache_n at least this share of what the RAM should hold: it served the prompt
RAM_MISS_PRIOR = (1, 1)      # Beta prior of a server's RAM miss rate: (misses, hits), so one half before any outcome
PROBE_PAYBACK = 20.0         # a RAM not seen lately is tried once restores spared 20 times the prefill a miss costs
                             # (then on every prompt while it serves them; after a miss, once the miss is forgotten)
RAM_TRUST = 8                # outcomes seen before the RAM's miss rate is trusted over "every return needs a file"
RAM_BET_GROWTH = 2.0         # a RAM that missed nothing lately is bet on for prompts up to twice the longest it served
                             # (or what it kept beside one it served, if more)
RAM_BET_SECONDS = 1.0        # ... or whose miss would cost at most this much prefill (`RamWatch.bets`)


class ServerCaches:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        # chain digest -> (backend index, that backend's `traffic` once the prompt was held)
        self._where: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.traffic: dict[int, int] = {}   # backend -> blocks of the prompts its slots held, summed
        # backend -> the latest prompts its slots held: (the `_where` entry of its chain, its last digest, blocks)
        self._holds: dict[int, deque[tuple[tuple[int, int], int, int]]] = {}
        # backend -> file name -> (chain, when it was lost, monotonic)
        self._lost: dict[int, OrderedDict[str, tuple[tuple[int, ...], float]]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def held(self, backend: int, chain: Sequence[int]) -> None:
        """A slot of `backend` held the prompt of this chain (the server copies it to its RAM once replaced)."""
        where = self._where
        mark = self.traffic[backend] = self.traffic.get(backend, 0) + len(chain)
        entry = (backend, mark)   # one tuple for the whole chain
        if chain:
            self._holds.setdefault(backend, deque(maxlen=HOLDS_KEPT)).append((entry, chain[-1], len(chain)))
        for digest in chain:
            where[digest] = entry
            where.move_to_end(digest)
        while len(where) > self.limit:
            where.popitem(last=False)

    def gone(self, backend: int, chain: Sequence[int], key: str | None = None, now: float | None = None) -> None:
        """A restore replaced what a slot of `backend` held without the server copying it to RAM; `key`: the file
        that holds it (saved first, `ram_reach.keeps`), remembered as lost to that server's RAM (`lost`)."""
        for digest in chain:
            if self._where.get(digest, (None, 0))[0] == backend:
                del self._where[digest]
        if key is not None and chain:
            lost = self._lost.setdefault(backend, OrderedDict())
            lost[key] = (tuple(chain), time.monotonic() if now is None else now)
            lost.move_to_end(key)
            while len(lost) > LOST_KEPT:
                lost.popitem(last=False)

    def lost(self, backend: int, now: float | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """(file, chain) of the caches a restore took out of `backend`'s RAM reach in the last LOST_SECONDS that no
        slot of it has held since, newest first: a return to one of them, sent unpinned, would compute it again."""
        lost = self._lost.get(backend)
        if not lost:
            return []
        now = time.monotonic() if now is None else now
        for key, (chain, at) in list(lost.items()):
            if now - at > LOST_SECONDS or self.find(chain) == (backend, len(chain)):
                del lost[key]   # old, or held again since (its conversation came back, or it was put back)
        return [(key, chain) for key, (chain, _) in reversed(lost.items())]

    def drop(self, backend: int, key: str) -> None:
        """A lost cache that cannot be put back (its file is gone, or its restore failed): forgotten."""
        lost = self._lost.get(backend)
        if lost is not None:
            lost.pop(key, None)

    def found_again(self, backend: int, key: str, chain: Sequence[int]) -> None:
        """A lost cache was put back where the server's RAM gets it (`flow.unpinned`)."""
        self.drop(backend, key)
        self.held(backend, chain)

    def forget(self, backend: int) -> None:
        """`backend` was restarted: its RAM holds none of it any more."""
        for digest in [d for d, (b, _) in self._where.items() if b == backend]:
            del self._where[digest]
        self._lost.pop(backend, None)
        self.traffic.pop(backend, None)
        self._holds.pop(backend, None)

    def find(self, chain: Sequence[int]) -> tuple[int, int] | None:
        """(backend, blocks): the server that last held the longest prefix of the chain, and how much of it."""
        deepest = self._deepest(chain)
        return None if deepest is None else (deepest[0][0], deepest[1])

    def _deepest(self, chain: Sequence[int]) -> tuple[tuple[int, int], int] | None:
        """(the `_where` entry, blocks) of the longest prefix of the chain held anywhere."""
        for depth in range(len(chain), 0, -1):
            found = self._where.get(chain[depth - 1])
            if found is not None:
                return found, depth
        return None

    def since(self, backend: int, chain: Sequence[int]) -> int:
        """Blocks of prompts `backend`'s slots held after the deepest prompt of the chain it held, that its RAM kept
        beside it if it serves that prompt again (`RamWatch.bets`): llama-server drops the oldest entries first, so
        the newer ones it stored are still there. Only the latest turn of each conversation counts (an entry that a
        longer one extends is removed; one a restore replaced unseen by the RAM, `gone`, is not there). And it stores
        no entry larger than its whole RAM, which leaves the older ones in place: so a prompt counts only if it is no
        longer than what is counted before it (the served prompt first), which the RAM then had room for. A long first
        turn after a short one, in a RAM too small for it, does not count. 0 when not found there."""
        deepest = self._deepest(chain)
        if deepest is None or deepest[0][0] != backend:
            return 0
        (_, mark), depth = deepest
        kept = depth
        where = self._where
        for entry, tip, blocks in self._holds.get(backend, ()):
            if entry[1] > mark and blocks <= kept and where.get(tip) is entry:
                kept += blocks
        return kept - depth


class RamWatch:
    """Whether a server's RAM prompt cache serves the prompts lpcache leaves to it, from what it did with the last
    ones (hits and misses, `seen`). A prompt is left to the RAM, rather than restored from a file, when the RAM's
    expected cost, its miss rate (with a prior of one half) times the prefill a miss costs, is below the restore's
    time, its wait for the server's batch included (`rely`). So a server never seen is relied on only where a miss
    would cost little more than the restore: behind a busy CPU, whose /slots calls wait for seconds, it is; where a
    restore takes milliseconds, it is not, and the RAM is tried now and then instead (`probe`: one started with
    `--cache-ram 0` loses one prefill every RAM_RETRY_SECONDS). Outcomes also come for free: a prompt with no file worth
    restoring goes where the RAM likely holds it anyway. What it misses (`miss_rate`) is also what a saved file is
    needed for (`worth`): where the RAM serves every return, nothing is saved. Outcomes older than
    RAM_RETRY_SECONDS are forgotten (the server may have been restarted since). The RAM of llama-server's default
    `--cache-ram` holds a few long conversations of a real model: it serves some, and misses the others; a small
    model's fit: it serves all. Where the server was asked whether it has a RAM cache at all (`present`,
    `backends.ram_check`), that answer replaces the even bet: a RAM that exists is tried at once (on prompts no
    longer than it has shown it keeps: `bets`), one that does not is never counted on."""

    def __init__(self) -> None:
        self.outcomes: deque[tuple[float, bool]] = deque(maxlen=RAM_WINDOW)
        # (when, tokens) per hit: what it showed it keeps (`bets`)
        self.kept_shown: deque[tuple[float, float]] = deque(maxlen=RAM_WINDOW)
        self.spared = 0.0   # seconds of prefill restores from files spared since the last probe
        self.probes = 0
        self.first_tried = False   # the one return risked, whatever its size, on a RAM that said it exists (`probe`)
        # what the server said when asked (`backends.ram_check`): True, a RAM cache serves pinned requests (relied
        # on from the first return it likely holds, for prompts of a size it has shown it keeps: `bets`, until it
        # misses one); False, none does (never probed nor relied on); None, not asked yet, or no clear answer
        # (learnt from the returns alone)
        self.present: bool | None = None
        self.generation = 0   # bumped at each restart: a check begun before one does not speak for the new server

    def forget(self) -> None:
        """The server was restarted: its RAM is empty, and whether it has one is asked again."""
        self.outcomes.clear()
        self.kept_shown.clear()
        self.first_tried = False
        self.spared = 0.0
        self.present = None
        self.generation += 1

    def answered(self, present: bool, generation: int) -> None:
        """What the check begun at `generation` found; void if the server restarted, or a return decided, since."""
        if generation == self.generation and self.present is None and not self.outcomes:
            self.present = present

    def seen(self, hit: bool, now: float, tokens: float, beside: float = 0.0) -> None:
        """A prompt left to the RAM came back: served (`hit`, `tokens` taken from the cache) or not; `beside`: the
        tokens of the prompts the server's slots held after it (`ServerCaches.since`), which its RAM kept too."""
        self.outcomes.append((now, hit))
        if hit:
            self.kept_shown.append((now, max(RAM_BET_GROWTH * tokens, tokens + beside)))
        if hit and self.present is False:
            self.present = None   # it served one after all: the check was wrong, and the returns decide
            self.generation += 1  # (and a check still under way does not say otherwise)

    @property
    def served(self) -> bool:
        """It served a prompt from RAM lately (as far as the window remembers)."""
        return any(hit for _, hit in self.outcomes)

    def recent(self, now: float) -> list[bool]:
        return [hit for t, hit in self.outcomes if now - t <= RAM_RETRY_SECONDS]

    def bets(self, tokens: float | None, prefill_s: float | None, now: float) -> bool:
        """Whether a prompt of `tokens` (a miss costing `prefill_s`) may be left to a RAM on the strength of what it
        has not missed: no more than it has shown it keeps lately, or a miss costing at most RAM_BET_SECONDS of
        prefill. What a hit shows it keeps: RAM_BET_GROWTH times the prompt it served, or that prompt and the
        prompts the server's slots held after it, if more (its RAM drops the oldest entries first, so it held those
        too). Nothing says how much a RAM holds (llama-server's /props does not tell its `--cache-ram`): one of a
        fifth of the working set serves the first, short returns and has dropped a long one long before it comes
        back. Bet on without a bound from its first hit, it left a 1,312-token return to be computed again
        (docs/benchmarks.md); bounded, that return is restored from its file. Bounded by the served prompts' sizes
        alone, a RAM that holds everything was never bet on where the short returns were few: each return restored,
        each turn saved, requests never unpinned, and the time to first token over the server alone's
        (docs/benchmarks.md, 2026-12-07). The bound guards the first returns, before a miss is seen; after that the
        misses are weighed (`rely`). A RAM that said it exists and has given nothing back yet is tried once
        whatever the size where a session's file would otherwise be restored (`probe`, which prefix mode does not
        ask: there a long return is restored until the RAM has served a shorter one)."""
        if tokens is None or (prefill_s is not None and prefill_s <= RAM_BET_SECONDS):
            return True
        return tokens <= max((n for t, n in self.kept_shown if now - t <= RAM_RETRY_SECONDS), default=0.0)

    def rely(self, prefill_s: float | None, restore_s: float | None, now: float, tokens: float | None = None) -> bool:
        """Whether to leave a prompt to the RAM rather than restore it from a file: a miss costs `prefill_s`, the
        restore `restore_s` (None: unknown); `tokens`: what the RAM should hold of it (None: not weighed by size)."""
        if self.present is False:
            return False
        recent = self.recent(now)
        if all(recent) and (self.present or recent) and not self.bets(tokens, prefill_s, now):
            return False   # longer than it has shown it keeps: its few hits (or the check) say nothing of it
        if self.present and all(recent):
            return True   # it said it has one, and has missed nothing lately: tried on every return it likely holds
        if prefill_s is None or restore_s is None:
            return bool(recent) and all(recent)   # nothing to weigh: only a RAM that served every recent prompt
        misses = (recent.count(False) + RAM_MISS_PRIOR[0]) / (len(recent) + sum(RAM_MISS_PRIOR))
        return misses * prefill_s < restore_s

    def probe(self, prefill_s: float | None, now: float, tokens: float | None = None) -> bool:
        """Whether to leave a prompt `rely` would restore to the RAM all the same, to find out whether it serves.
        Without probes a RAM never tried stays at a miss rate of one half, which on a CPU never beats a restore: a
        server whose default RAM cache holds every conversation would see each return restored from a file saved
        for it, the saves and restores stalling its batch, and nothing would show that both could stop. A probe
        costs at most one prefill the server alone would also compute had its RAM missed; a RAM not seen lately is
        tried once the files' restores have spared PROBE_PAYBACK times that prefill since the last probe (so on a
        server started with `--cache-ram 0` the misses cost at most a twentieth of what the files spare, and only
        one every RAM_RETRY_SECONDS), then on every prompt while it serves them, and after a miss not until that
        miss is forgotten. One that said it has none (`present`) is never probed (one that said it has one is relied
        on while it misses nothing, `rely`). No cap in seconds: a probe's miss is what the server alone
        computes for that prompt, and on a slow CPU every return of a chat may take seconds to compute (a fixed cap
        there meant never probing)."""
        if prefill_s is None or self.present is False:
            return False
        recent = self.recent(now)
        if not all(recent) or (recent and not self.bets(tokens, prefill_s, now)):
            return False
        if not recent and self.present and not self.first_tried:
            # it said it has one and nothing has come back yet: one return is risked whatever its size (a
            # workload of long prompts only would otherwise never learn what it keeps)
            self.first_tried = True
            self.probes += 1
            return True
        if not recent and self.spared < PROBE_PAYBACK * prefill_s:
            return False
        self.spared = 0.0
        self.probes += 1
        return True

    def restored(self, spared_s: float | None) -> None:
        """A restore from a file spared this much prefill (what pays for the next probe)."""
        self.spared += spared_s or 0.0

    def miss_rate(self, now: float) -> float:
        """The share of the prompts left to it that the RAM missed lately; 1 (every return needs a file) until
        RAM_TRUST outcomes are seen. A saved file is needed only where the RAM misses (`worth`)."""
        recent = self.recent(now)
        return recent.count(False) / len(recent) if len(recent) >= RAM_TRUST else 1.0
