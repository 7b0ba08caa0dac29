"""The index's limits: META_MAX files and META_MAX_GIB bytes, what goes first when they bite (files a later save
moved on from, then those an idle slot still holds, then the replacement order of `eviction`), and what is never
deleted (a file a request is restoring or saving, here or on another replica)."""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence

from lpcache.cache.eviction import Usage, UsageTable
from lpcache.cache.holders import Table, levels_of
from lpcache.cache.meta_files import MetaEntry
from lpcache.cache.prefix import Prompt

MOVED_ON_TAIL = (4, 0.1)   # an entry a new save shares all but this many identity blocks (or share) of has moved on
GHOSTS_MIN = 1024   # usage records of deleted entries kept (at least; 4 x META_MAX when that is more)


class IndexLimits:
    """What the limits take out of the index, and when (`MetaIndex` is one)."""

    wpb: int
    meta_max: int
    max_bytes: int
    slot_save_paths: tuple[str, ...]
    held: Callable[[], Collection[str]]
    in_slots: Callable[[], Collection[str]]
    in_use_elsewhere: Callable[[], Collection[str]]
    evicted: int
    _entries: dict[str, MetaEntry]
    _usage: UsageTable
    _exact: dict[str, Table]
    _ends: dict[str, Table]
    _protected: dict[str, int]
    _saving: set[str]
    _moved_on: OrderedDict[str, None]
    _why: dict[str, str]
    _ghosts: OrderedDict[tuple[str, int], Usage]

    _remove: Callable[[MetaEntry], None]                                       # MetaIndex's
    _delete_files: Callable[[str | None, bytes, list[MetaEntry]], Awaitable[None]]   # MetaFiles'

    def disk_bytes(self, limit: int = 10000) -> int | None:
        """The size of the KV files of the entries (in the folders visible here): the disk the caches use.
        None when no folder is visible; at most `limit` files are looked at."""
        return self.disk_bytes_of(self.kv_files(limit))

    def kv_files(self, limit: int = 10000) -> list[tuple[str, ...]]:
        """Where the KV file of each of the `limit` most recent entries may be: taken on the event loop, so that
        `disk_bytes_of` can stat them in a worker thread while entries change."""
        folders = self.slot_save_paths
        return [tuple(os.path.join(f, e.key) for f in {e.slot_save_path, *folders} if f)
                for e in itertools.islice(reversed(self._entries.values()), limit)]

    @staticmethod
    def disk_bytes_of(files: list[tuple[str, ...]]) -> int | None:
        """The size of the first existing path of each entry's; None when there are entries and none exists."""
        total, seen = 0, False
        for paths in files:
            for path in paths:
                try:
                    total += os.stat(path).st_size
                    seen = True
                    break
                except OSError:
                    continue
        return total if seen or not files else None

    def _redundant(self, new: MetaEntry, in_use: Collection[str] | None = None) -> list[MetaEntry]:
        if new.foreign:
            return []
        ends = self._ends.get(new.fingerprint or "", {})
        found = []
        in_use = self.files_in_use() if in_use is None else in_use
        for digest in new.exact:
            holders = ends.get(digest)
            if holders is None:
                continue
            for key in ((holders,) if isinstance(holders, str) else tuple(holders)):
                e = self._entries[key]
                if (e.key != new.key and e.slot_save_path == new.slot_save_path and e.backend == new.backend
                        and key not in in_use):
                    found.append(e)
        return found

    def excess_after(self, prompt: Prompt, key: str, backend: str | None, slot_save_path: str | None,
                     fingerprint: str | None, tokens: int | None = None) -> int:
        """How many entries the limits would make go if this prompt's cache (`tokens` long, when known) were
        recorded now under `key`, beyond the ones `add` removes first (those it makes redundant, and those a later
        turn moved on from): 0 when it fits. For META_MAX_GIB, the file's size is guessed from the bytes per token
        of the files already saved, and counted as one entry more when it does not fit."""
        count, size = self._limits()
        new = key not in self._entries
        size_guess = self._bytes_per_token() * (tokens or 0) if size > 0 else 0.0
        over_count = count > 0 and len(self._entries) + new > count
        over_bytes = size > 0 and size_guess > 0 and self._usage.total_bytes + size_guess > size
        if not (over_count or over_bytes):
            return 0
        entry = MetaEntry(key, prompt.model, self.wpb, prompt.chain, 0.0, prompt.n_words, backend, slot_save_path,
                          prompt.exact, fingerprint)
        in_use = self.files_in_use()
        redundant = self._redundant(entry, in_use)
        gone = {r.key for r in redundant} | ({c.key for c in self._continued(entry, redundant)}
                                            | self._moved_on.keys()) - in_use
        gone = (gone & self._entries.keys()) - {key}
        excess = max(0, len(self._entries) + new - len(gone) - count) if count > 0 else 0
        if size > 0 and size_guess > 0:
            left = self._usage.total_bytes - sum(u.size for k in gone if (u := self._usage.get(k)) is not None)
            excess = max(excess, int(left + size_guess > size))
        return excess

    def _bytes_per_token(self) -> float:
        """Bytes per token of the files saved (their sizes and token counts as the servers reported): 0 unknown."""
        sized = [(e.size, e.n_tokens) for e in itertools.islice(reversed(self._entries.values()), 64)
                 if e.size and e.n_tokens]
        return sum(s for s, _ in sized) / sum(n for _, n in sized) if sized else 0.0

    def files_in_use(self) -> set[str]:
        """Entries whose files a request is using: chosen for a restore not run yet, being saved again (the file is
        being rewritten), or either of these by another replica's request (`in_use_elsewhere`). Never deleted."""
        return {*self._protected, *self._saving, *self.in_use_elsewhere()}

    def _over_limit(self, keep: str) -> list[MetaEntry]:
        """Delete until META_MAX and META_MAX_GIB hold, never an entry in use (`files_in_use`), and `keep` (the entry
        just saved) only when an idle slot holds it, in this order:

        1. files a later save of the same conversation has moved on from (`_continued`): it holds all of theirs but
           a short end, oldest first;
        2. files of caches an idle slot still holds (`held`): the slot serves them while it keeps them, and saves
           them again before a restore or another prompt replaces them (`slot_fill.prepare`), so the limits then
           hold the caches no slot has (META_MAX files plus one per slot in all);
        3. the rest, by the replacement order (`eviction`): the one needed furthest in the future first; the
           files of caches an idle slot holds (`in_slots`) only when nothing else is left (the replacement order
           puts the entries just used furthest away, and deleting one means writing it again before its slot is
           replaced: where a file beside the slots is not worth that write, step 2 leaves them here).
        """
        in_use = self.files_in_use()
        spare = {keep, *in_use}
        removed = self._evict_among(list(self._moved_on), spare, "moved_on")
        # the entry just saved too, when a slot has it
        removed += self._evict_among(self.held(), in_use, "in_slot")
        if self.over():
            count, size = self._limits()
            now = time.time()
            slots_held = set(self.in_slots()) - spare
            for spared in (spare | slots_held, spare) if slots_held else (spare,):
                for key in self._usage.victims(now, count, size, spared):
                    entry = self._entries.get(key)
                    if entry is not None:
                        self._evict_entry(entry, "in_slot" if key in slots_held else "limit")
                        removed.append(entry)
                if not self.over():
                    break
        self.evicted += len(removed)
        return removed

    async def enforce(self) -> None:
        """Delete what the limits say, now that nothing may be waiting to be restored (see `_over_limit`)."""
        removed = self._over_limit(keep="")
        if removed:
            await self._delete_files(None, b"", removed)

    def over(self) -> bool:
        """Beyond the limits (left so for a moment by a save while a restore was chosen: see `_limits`)."""
        count, size = self._limits()
        return (count > 0 and len(self._entries) > count) or (size > 0 and self._usage.total_bytes > size)

    def _limits(self) -> tuple[int, int]:
        """META_MAX and META_MAX_GIB (0: none), not counting the files chosen for restores that have not run yet:
        such a restore replaces a slot's cache, which is saved first, so for a moment both files are needed; once
        restored, the chosen file is held by its slot and the next save makes room (`moved_on`, `in_slot`)."""
        if not self._protected:
            return self.meta_max, self.max_bytes
        chosen = [u for k in self._protected if (u := self._usage.get(k)) is not None]
        return (self.meta_max + len(chosen) if self.meta_max > 0 else 0,
                self.max_bytes + sum(u.size for u in chosen) if self.max_bytes > 0 else 0)

    def _evict_among(self, keys: Iterable[str], spare: Collection[str], why: str) -> list[MetaEntry]:
        removed: list[MetaEntry] = []
        for key in keys:
            if not self.over():
                break
            entry = self._entries.get(key)
            if entry is not None and key not in spare:
                self._evict_entry(entry, why)
                removed.append(entry)
        return removed

    def _evict_entry(self, entry: MetaEntry, why: str) -> None:
        """Out of the index, its usage kept as a ghost (a later save of its conversation takes it over); `why` is
        logged with its deletion."""
        self._why[entry.key] = why
        usage = self._usage.get(entry.key)
        if usage is not None and not entry.foreign:
            self._ghosts[(entry.fingerprint or "", entry.exact[-1])] = usage
            while len(self._ghosts) > max(GHOSTS_MIN, 4 * self.meta_max):
                self._ghosts.popitem(last=False)
        self._remove(entry)

    def _continued(self, new: MetaEntry, redundant: Collection[MetaEntry]) -> list[MetaEntry]:
        """The entries (same model) a new save continues without making them redundant: it shares all of their
        identity chain but a short end (MOVED_ON_TAIL), as the next turn of a conversation does when its request
        changes only the last lines (a task after a growing document, a regenerated last message); in any folder:
        the conversation has moved on to the new save's server. They stay while there is room, and go first when
        there is not; the new entry takes their rhythm over."""
        if new.foreign:
            return []
        return self._ends_within(new.fingerprint or "", new.exact, {new.key, *(r.key for r in redundant)})

    def covered(self, fingerprint: str | None, chain: Sequence[int]) -> list[str]:
        """The entries a cache of this identity chain holds all of but a short end (a slot's cache that continued
        them): while a slot holds it and saves it before replacing it, their files can go."""
        if fingerprint is None or not chain:
            return []
        return [e.key for e in self._ends_within(fingerprint, chain, ())]

    def _ends_within(self, fingerprint: str, chain: Sequence[int], skip: Collection[str]) -> list[MetaEntry]:
        """Entries of the model sharing all of their identity chain with `chain` but at most MOVED_ON_TAIL blocks,
        looked for among the holders of the last 8 levels `chain` shares with any entry (at most 64 a level)."""
        table = self._exact.get(fingerprint)
        if not table:
            return []
        levels = levels_of(table, chain)
        out: dict[str, MetaEntry] = {}
        for depth in range(len(levels), max(0, len(levels) - 8), -1):
            holders = levels[depth - 1]
            for n, key in enumerate((holders,) if isinstance(holders, str) else holders):
                if n >= 64:
                    break
                e = self._entries[key]
                if key not in skip and key not in out and (
                        len(e.exact) - depth <= max(MOVED_ON_TAIL[0], MOVED_ON_TAIL[1] * len(e.exact))):
                    out[key] = e
        return list(out.values())

    def _ghost_of(self, entry: MetaEntry, now: float) -> list[Usage]:
        """The usage of a deleted entry whose conversation this new save continues (its chain passes through the
        digest the deleted one ended at): the request that made this save is its use."""
        if entry.foreign or not self._ghosts:
            return []
        fingerprint = entry.fingerprint or ""
        for digest in reversed(entry.exact):
            ghost = self._ghosts.pop((fingerprint, digest), None)
            if ghost is not None:
                ghost.use(now)
                return [ghost]
        return []
