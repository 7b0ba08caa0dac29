"""What a slot's cache is worth on disk: the cost model behind `BIG_THRESHOLD_WORDS=auto`, and what a fixed
threshold or file count costs.

A saved cache pays when a later request needs it from its file (its conversation came back, and neither a slot nor
the server's RAM prompt cache still holds it) and reading it back is quicker than computing it again. For a cache of
T tokens, on the backend and model that made it (`speeds`, times per token; `wait`: what a /slots call waits for the
server's batch under way):

    worth saving  when  need x ((prefill - restore) x T - wait)  >  MARGIN x save x T

`need` is the share of prompts a later request continued while no slot and no RAM cache held them any more: learnt
from the requests themselves (`ReturnWatch`), saved or not, so it does not depend on what was saved; times the share
of the prompts left to the server's RAM prompt cache that it missed lately (`server_cache.RamWatch`, 1 while unknown:
a return restored from a file says nothing about whether the RAM would have served it, so the RAM is tried now and
then, `RamWatch.probe`). MARGIN (2) keeps
the costs a per-token rate leaves out on the side of not saving: a save stalls the whole server while it writes (every
slot's request waits), the files take disk space, a request may come back before its file is needed. The wait is the
restore's, a fixed cost the returning request pays: a cache whose prefill is shorter than it is not worth a file. A
save's own wait is not weighed: the server goes on with its batch meanwhile, and only lpcache's slot waits, after
the client has its answer (weighing it left every short turn on a busy CPU unsaved, and computed again).
On a CPU or an Apple chip a token's prefill costs milliseconds and its save or restore microseconds: nearly every
conversation's cache is saved, short turns included. On a GPU the prefill is as quick as the disk: nothing is, and
no byte is written. Where the server's RAM prompt cache serves the returns, few are needed from a file, and the
prefill a file would spare no longer pays for its save: nothing is saved either.

Before a save has been measured on a backend there is no save rate: a cache is then saved when its own prefill took at
least PROBE_SECONDS, which is where a save cannot cost much in comparison on any disk, and is what teaches the rate.

The same watch says what a fixed setting costs (`Worth.came_back`): a request that computes again a prefix an earlier
request had, when that earlier cache was not saved because of BIG_THRESHOLD_WORDS (`threshold`), or was saved but its
file is gone (`limit`: META_MAX or META_MAX_GIB deleted it), or `auto` judged it not worth a file (`not_worth`),
counted in tokens and in seconds of prefill at the backend's speed; the first of each kind is logged once with the
setting that would have caught it.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass

from lpcache.cache.speeds import Speeds

log = logging.getLogger("lpcache.worth")

MARGIN = 2.0              # the prefill spared must be worth this many times the save
PROBE_SECONDS = 0.1       # until a save was measured: a cache whose prefill took this long is saved
NEED_PRIOR = (1.0, 1.0)   # Beta prior of the need rate: (needed, not needed), so 0.5 before anything is seen
SEEN_MAX = 8192           # prompts remembered (a few hundred bytes each)
HORIZON_MIN = 120.0       # a prompt not continued within max(HORIZON_MIN, HORIZON_GAPS x the typical gap) ...
HORIZON_GAPS = 4.0        # ... counts as one that did not come back
HORIZON_MAX = 86400.0
GAPS_KEPT = 64            # recent gaps between a prompt and its continuation (the typical gap: their median)
SERVED_SHARE = 0.9        # cache_n at least this share of the earlier prompt's tokens: something held it
MISSED_KINDS = ("threshold", "limit", "not_worth")
# Why a cache was (first two) or was not saved under auto: worth a file; saved to learn what a save costs (`probe`);
# no save measured yet and its prefill too short to learn from; not worth a file; no prefill speed known yet; worth
# a file, but left to the server's RAM prompt cache while requests wait (its miss would cost a second at most).
DECISIONS = ("worth", "probe", "probe_too_short", "not_worth", "no_speed", "left_to_ram")


@dataclass(slots=True)
class Seen:
    """A prompt a request left in its slot, remembered until a later request continues it or it is forgotten."""

    depth: int              # identity blocks of its prompt
    tokens: int             # tokens its slot held after the answer (prompt and answer), as the server counted
    prompt_tokens: int
    words: int
    key: str                # the file it is (or would be) saved under
    why: str                # "" saved (or meant to be), else why not: "threshold", "not_worth"
    at: float               # monotonic time


class ReturnWatch:
    """Which prompts come back, and whether they were still held when they did.

    Every request's prompt is remembered by the last digest of its identity chain (`identity`): the next turn of a
    conversation renders the earlier messages first, so its chain passes through that digest. When a request
    continues a remembered prompt, the prompt is resolved: `held` (its slot, or the server's RAM, still had it) or
    `needed` (only a file could have spared its prefill). A prompt not continued within the horizon is resolved as
    `gone`. The need rate is needed / resolved, with a weak prior."""

    def __init__(self, limit: int = SEEN_MAX) -> None:
        self.limit = limit
        self._seen: OrderedDict[tuple[str, int], Seen] = OrderedDict()
        self._gaps: deque[float] = deque(maxlen=GAPS_KEPT)
        self.needed = 0
        self.held = 0
        self.gone = 0

    def __len__(self) -> int:
        return len(self._seen)

    def rate(self) -> float:
        """The share of prompts a later request needed from a file (the Beta prior's mean before anything)."""
        a, b = NEED_PRIOR
        return (self.needed + a) / (self.needed + self.held + self.gone + a + b)

    def horizon(self) -> float:
        typical = statistics.median(self._gaps) if self._gaps else 0.0
        return min(HORIZON_MAX, max(HORIZON_MIN, HORIZON_GAPS * typical))

    def seen(self, model: str, chain: tuple[int, ...], seen: Seen) -> None:
        """A request left this prompt in its slot."""
        if not chain:
            return
        key = (model, chain[-1])
        self._seen[key] = seen
        self._seen.move_to_end(key)
        self._expire(seen.at)

    def continued(self, model: str, chain: tuple[int, ...], now: float) -> Seen | None:
        """The deepest remembered prompt of the model this chain continues (its whole chain is a prefix of this
        one), taken out of the watch; the caller resolves it (`resolve`)."""
        seen = self._seen
        for depth in range(len(chain), 0, -1):
            found = seen.get((model, chain[depth - 1]))
            if found is not None and found.depth == depth:
                del seen[(model, chain[depth - 1])]
                self._gaps.append(max(0.0, now - found.at))
                return found
        return None

    def resolve(self, needed: bool) -> None:
        if needed:
            self.needed += 1
        else:
            self.held += 1

    def _expire(self, now: float) -> None:
        horizon = self.horizon()
        seen = self._seen
        while seen:
            first = next(iter(seen.values()))
            if len(seen) <= self.limit and now - first.at <= horizon:
                break
            seen.popitem(last=False)
            self.gone += 1


class Worth:
    """Decides, under `BIG_THRESHOLD_WORDS=auto`, whether a cache is worth a file; and counts, under any setting, the
    prefill a file would have spared (`missed`)."""

    def __init__(self, auto: bool, threshold: int | None, meta_max: int) -> None:
        self.auto = auto
        self.threshold = threshold
        self.meta_max = meta_max
        self.watch = ReturnWatch()
        self.decisions: dict[str, int] = dict.fromkeys(DECISIONS, 0)
        self._told: set[str] = set()

    def decide(self, speeds: Speeds, tokens: int | None, prefill_ms: float | None,
               prompt_n: int | None, ram_miss: float = 1.0, ram_keeps: bool = False) -> tuple[bool, str]:
        """Whether a cache of `tokens` tokens (prompt and answer) is worth saving at these speeds, and why (one of
        DECISIONS). `ram_miss`: the share of prompts left to the server's RAM prompt cache that it missed lately
        (`server_cache.RamWatch.miss_rate`, 1 when unknown): a return the RAM serves needs no file. `ram_keeps`:
        the server has a RAM cache that missed nothing lately, a miss of this cache would cost at most a second of
        prefill, and requests wait for a slot: a save now would cost them its wait for the server's batch under
        way, and the server copies the cache to its RAM when the slot is taken (`flow.saving.Saver.ram_keeps`), so
        a cache worth a file is left to the RAM."""
        if not tokens:
            return self._count(False, "no_speed")
        p = speeds.prefill.ms_per_token
        if p is None and prefill_ms and prompt_n:
            p = prefill_ms / prompt_n   # this request's own prefill, too short to be learnt from
        if p is None:
            return self._count(False, "no_speed")
        s = speeds.save.ms_per_token
        if s is None:
            probe = p * tokens >= PROBE_SECONDS * 1000.0
            return self._count(probe, "probe" if probe else "probe_too_short")
        worth = self._spares(p, speeds, tokens, ram_miss) > MARGIN * s * tokens
        if worth and ram_keeps:
            return self._count(False, "left_to_ram")
        return self._count(worth, "worth" if worth else "not_worth")

    def spares_ms(self, speeds: Speeds, tokens: int, ram_miss: float = 1.0) -> float | None:
        """The prefill, in ms, a file of a cache of `tokens` tokens is expected to spare (the need rate times what a
        return restoring it saves over computing it); None while the prefill or the save speed is unknown."""
        p = speeds.prefill.ms_per_token
        if p is None or speeds.save.ms_per_token is None:
            return None
        return self._spares(p, speeds, tokens, ram_miss)

    def _spares(self, p: float, speeds: Speeds, tokens: int, ram_miss: float) -> float:
        r = speeds.restore.ms_per_token
        if r is None:
            r = speeds.save.ms_per_token or 0.0   # reading a file back costs about what writing it did
        wait = speeds.wait_ms or 0.0   # the restore's /slots call waits for the server's batch under way
        return self.watch.rate() * ram_miss * ((p - r) * tokens - wait)

    @staticmethod
    def per_byte(speeds: Speeds, tokens: int | None, size: int | None) -> float | None:
        """The prefill milliseconds a file of `tokens` tokens and `size` bytes spares per byte read back (the
        replacement order of `eviction` weighs files by it); None when a speed or the size is unknown."""
        p, r = speeds.prefill.ms_per_token, speeds.restore.ms_per_token or speeds.save.ms_per_token
        if p is None or r is None or not tokens or not size or p <= r:
            return None
        return (p - r) * tokens / size

    def _count(self, worth: bool, why: str) -> tuple[bool, str]:
        self.decisions[why] += 1
        return worth, why

    def describe(self, speeds: Speeds, ram_miss: float = 1.0) -> str:
        """The figures a decision rests on, for a log line."""
        parts = [f"need_rate={self.watch.rate():.3f}", f"ram_miss={ram_miss:.3f}"]
        parts += [f"{k}={v:.4f}" for k, v in speeds.describe().items() if v is not None]
        return " ".join(parts)

    def came_back(self, seen: Seen, held: bool, restored: bool, prompt_tokens: int | None, cache_n: int | None,
                  file_kept: bool, speeds: Speeds) -> tuple[str, int, float] | None:
        """A request continued `seen`: resolve it for the need rate, and return the prefill it computed again that a
        file would have spared, as (kind, tokens, seconds), if any. `held`: the slot it got held all of `seen`;
        `restored`: a file was restored into it; `file_kept`: `seen`'s own file is still there (if it had one)."""
        if cache_n is None or prompt_tokens is None:
            return None
        reusable = min(seen.tokens, prompt_tokens)
        served = held or (not restored and cache_n >= SERVED_SHARE * min(seen.prompt_tokens, prompt_tokens))
        self.watch.resolve(not served)
        if served or restored:
            return None
        lost = reusable - cache_n
        kind = seen.why or ("" if file_kept else "limit")
        if lost <= 0 or kind not in MISSED_KINDS:
            return None
        seconds = speeds.prefill.seconds(lost) or 0.0
        if kind not in self._told and kind != "not_worth":
            self._told.add(kind)
            log.warning("settings_cost %s: a request computed again %d tokens (%.2f s of prefill) that %s; %s. "
                        "Counted in lpcache_prefill_missed_tokens_total and on the dashboard; logged once.",
                        self.setting(kind), lost, seconds, self.what(kind, seen), self.catch(kind, seen))
        return kind, lost, seconds

    def setting(self, kind: str) -> str:
        if kind == "threshold":
            return f"BIG_THRESHOLD_WORDS={self.threshold}"
        return f"META_MAX={self.meta_max}" if self.meta_max else "META_MAX_GIB"

    def what(self, kind: str, seen: Seen) -> str:
        if kind == "threshold":
            return f"an earlier request of {seen.words} words had computed, and its cache was not saved"
        return "an earlier request's saved cache held, but its file had been deleted by the limits"

    def catch(self, kind: str, seen: Seen) -> str:
        if kind == "threshold":
            return (f"BIG_THRESHOLD_WORDS=auto saves what pays on this hardware (or a threshold below {seen.words} "
                    "words would have caught it)")
        return ("BIG_THRESHOLD_WORDS=auto with META_MAX unset keeps files by their value within META_MAX_GIB's bytes "
                "(or raise the limit)")

    def note(self, model: str, chain: tuple[int, ...], seen: Seen) -> None:
        self.watch.seen(model, chain, seen)
