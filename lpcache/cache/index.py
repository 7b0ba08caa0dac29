"""The saved caches: `<key>.meta.json` files in META_DIR, and an in-memory index over them.

The Rust lpcache scans META_DIR on every big request. Here the files are read once, at start, and the index is kept
current on every save, restore and prune, so finding the saved cache that shares the longest prefix with a prompt
costs one dict lookup per block of the prompt, whatever the number of entries.

An entry lpcache wrote knows exactly what its file holds (the prompt's identity chain, `identity`) and which model
made it (the server's fingerprint): it is found by that chain, among the entries of the fingerprints that can serve
the request, and never offered to another model. An entry from the Rust lpcache or proxycache knows only its word
blocks and client model name: it is found by words, tried, and judged by what the server reports afterwards.

An entry chosen for a restore is protected until the restore is done: neither a newer save that supersedes it nor
the limits (META_MAX, META_MAX_GIB: `index_limits`) delete it meanwhile. The files themselves, their names and
their one I/O thread are `meta_files`'; the lookup tables' holders, `holders`'.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import orjson

from lpcache.cache.eviction import Usage, UsageTable
from lpcache.cache.holders import add_holder, drop_holder, levels_of
from lpcache.cache.index_limits import IndexLimits
from lpcache.cache.meta_files import (
    _KEY,
    _TMP,
    MARKER_SUFFIX,
    META_SUFFIX,
    Candidate,
    MetaEntry,
    MetaFiles,
    _unlink,
    _unlink_regular,
    check_meta_dir,
    entry_from_document,
    file_in,
    inside,
    meta_document,
    read_regular,
    valid_key,
)
from lpcache.cache.orphans import remove_unnamed, unnamed_files
from lpcache.cache.prefix import Prompt

log = logging.getLogger("lpcache.index")
SKIPPED_LOGGED = 20   # `meta_skipped` lines at start; the rest are counted in one line


class MetaIndex(MetaFiles, IndexLimits):
    """Meta files on disk, their replacement order, and prefix indexes for restore lookups.

    `_exact[fingerprint][d]` holds the key (or the set of keys) of the entries of that model whose first i+1 identity
    blocks have the chain digest d; `_words[model]` the same over word blocks for foreign entries. `_ends` holds, per
    fingerprint, the entries whose chain ends at a digest, to find the entries a new save makes redundant.
    """

    def __init__(self, meta_dir: str, words_per_block: int, meta_max: int,
                 slot_save_paths: Iterable[str] = (), max_bytes: int = 0) -> None:
        self.meta_dir = meta_dir
        self.wpb = words_per_block
        self.meta_max = meta_max
        self.max_bytes = max_bytes
        self.slot_save_paths = tuple(slot_save_paths)
        # The folders KV files are ever deleted in: those lpcache was given (and those its own saves name), never
        # one a meta file on disk names.
        self._folders = set(self.slot_save_paths)
        self._entries: dict[str, MetaEntry] = {}
        self._usage = UsageTable()   # uses, sizes and the replacement order
        self._exact: dict[str, dict[int, str | set[str]]] = {}
        self._words: dict[str, dict[int, str | set[str]]] = {}
        self._ends: dict[str, dict[int, str | set[str]]] = {}
        self._protected: dict[str, int] = {}
        self._saving: set[str] = set()   # keys whose save is out (`saving`) and not recorded yet: never deleted
        self._unlinking: dict[str, int] = {}   # keys whose files a queued I/O job deletes (jobs per key)
        self._moved_on: OrderedDict[str, None] = OrderedDict()   # entries a later save continues (`_continued`)
        self._why: dict[str, str] = {}   # why an entry the limits removed goes, until its files are deleted
        # The keys of files an idle slot can give back (set by the slot filler: its own saved cache's, and those its
        # cache holds all of but a short end): they go early when the limits bite, since a slot's cache is saved
        # again before anything replaces it (see `_over_limit`).
        self.held: Callable[[], Collection[str]] = tuple
        # The files of the caches idle slots hold (set by the slot filler): the replacement order takes them last.
        self.in_slots: Callable[[], Collection[str]] = tuple
        # With REDIS_URL (`fleet.replica.Fleet.files_in_use`): the files other replicas' requests restore or save now.
        self.in_use_elsewhere: Callable[[], Collection[str]] = tuple
        # With REDIS_URL (`Fleet.names`): whether the shared index has an entry of that name, readable here or not.
        self.named_elsewhere: Callable[[str], bool] = _named_nowhere
        # The usage of entries the limits deleted, by the digest their chain ended at: a conversation that comes
        # back with a new save takes its rhythm over (a deleted file would otherwise make it look brand new, and
        # the first to go again). Bounded: the oldest are forgotten.
        self._ghosts: OrderedDict[tuple[str, int], Usage] = OrderedDict()
        # With REDIS_URL (`fleet`): told of each entry this replica adds (its meta document) or removes (None), for
        # the other replicas; not of the changes it applies from them (`apply`).
        self.publish: Callable[[str, bytes | None], None] | None = None
        self._applying = False
        self.evicted = 0          # entries deleted by the limits since start
        self.lost = 0             # restores that found their entry gone (see `lost_restore`)
        self.orphans_removed = 0  # files no entry named, deleted after their grace period (`orphans`)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpcache-meta")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> MetaEntry | None:
        return self._entries.get(key)

    @property
    def total_bytes(self) -> int:
        """The size of the files of the entries, as the servers reported them when saving."""
        return self._usage.total_bytes

    # ---- start-up ----

    def load(self) -> int:
        """Read every meta file, then reconcile the slot-save folders with them (`reconcile`). A file that is not
        lpcache's (another name, not a regular file, corrupt) is skipped with a warning and never opened when it
        is not a regular file. Returns the number of entries loaded. ConfigError when META_DIR is unusable."""
        check_meta_dir(self.meta_dir)
        loaded: list[MetaEntry] = []
        markers: list[str] = []
        skipped = 0
        with os.scandir(self.meta_dir) as found:
            names = sorted(e.name for e in found)
        for name in names:
            path = os.path.join(self.meta_dir, name)
            if _TMP.fullmatch(name):
                _unlink_regular(path)  # a write that never finished
                continue
            if name.endswith(MARKER_SUFFIX) and valid_key(name[: -len(MARKER_SUFFIX)]):
                markers.append(name[: -len(MARKER_SUFFIX)])
                continue
            if not name.endswith(META_SUFFIX):
                continue
            key = name[: -len(META_SUFFIX)]
            try:
                loaded.append(entry_from_document(key, orjson.loads(read_regular(path))))
            except (OSError, ValueError) as e:
                skipped += 1
                if skipped <= SKIPPED_LOGGED:
                    log.warning("meta_skipped file=%s reason=%s", path, e)
        if skipped > SKIPPED_LOGGED:
            log.warning("meta_skipped count=%d (the first %d are named above)", skipped, SKIPPED_LOGGED)
        for entry in sorted(loaded, key=lambda e: e.timestamp):
            self._insert(entry)
        self.reconcile(markers)
        return len(loaded)

    def reconcile(self, markers: Iterable[str]) -> None:
        """The rule for KV files without a meta file, at start (docs/operations.md, "Files lpcache keeps"):

        - lpcache announces each prefix-mode save with a marker `<key>.saving` in META_DIR before the server
          writes the file, and removes it with the meta file's write (or the failed save's clean-up). A marker
          left by a stop or crash in between names a file lpcache made but never recorded: without its meta file
          nothing can find it, so it is deleted from the slot-save folders lpcache was given (`kv_file_removed
          ... reason=unrecorded`); when a meta file of that key exists, the file is a newer save of the same
          prompt and is kept.
        - Session files (`<route tag>_<session>.bin`) have no meta file: their name says what they are, they are
          found by it and counted by MAX_FILES / MAX_GIB. Kept.
        - Any other file is not deleted here; a 64-hex-digit one with neither meta file nor marker is counted in
          one line (`kv_files_unknown`), and goes once untouched for ORPHAN_GRACE_SECONDS (`orphans`).
        """
        for key in markers:
            if key not in self._entries:
                for folder in self._folders:
                    path = inside(folder, key)
                    if path is not None and _unlink_regular(path):
                        log.info("kv_file_removed key=%s folder=%s reason=unrecorded", key, folder)
            _unlink(self._marker_path(key))
        for folder in sorted(self._folders):
            count = size = 0
            try:
                with os.scandir(folder) as found:
                    for e in found:
                        if _KEY.fullmatch(e.name) and e.name not in self._entries and e.is_file():
                            count += 1
                            size += e.stat().st_size
            except OSError:
                continue   # not visible here
            if count:
                log.info("kv_files_unknown folder=%s count=%d bytes=%d: files named like prefix caches that no "
                         "meta file describes; deleted once untouched for ORPHAN_GRACE_SECONDS (unless 0)",
                         folder, count, size)

    # ---- lookups ----

    def find(self, prompt: Prompt, fingerprints: Collection[str] = (),
             usable: Callable[[MetaEntry], bool] = lambda e: True, threshold: float = 0.0) -> Candidate | None:
        """The usable entry sharing the most identity blocks with the prompt, exactly, among the entries of the
        given model fingerprints; a foreign entry (word blocks only) when it shares more, as far as words tell.
        None when the best share is below `threshold` (of the prompt's identity blocks).

        Longest shared prefix wins, not the highest ratio: a cached system prompt alone must not beat a long
        conversation. Cost: one dict lookup per shared block, plus the entries tied at the deepest level.
        """
        total = len(prompt.exact)
        if not total:
            return None
        best: Candidate | None = None
        for fingerprint in fingerprints:
            found = self._deepest(self._exact.get(fingerprint), prompt.exact, usable)
            if found is not None and (best is None or found[1] > best.shared or (
                    found[1] == best.shared and found[0].timestamp > best.entry.timestamp)):
                best = Candidate(found[0], found[1], found[1] / total)
        if prompt.chain:
            found = self._deepest(self._words.get(prompt.model), prompt.chain, usable)
            if found is not None:
                shared = found[1] * total // len(prompt.chain)
                if shared and (best is None or shared > best.shared):
                    best = Candidate(found[0], shared, shared / total, exact=False)
        if best is None or best.ratio < threshold:
            return None
        return best

    def _deepest(self, table: dict[int, str | set[str]] | None, chain: tuple[int, ...],
                 usable: Callable[[MetaEntry], bool]) -> tuple[MetaEntry, int] | None:
        if not table:
            return None
        levels = levels_of(table, chain)
        for depth in range(len(levels), 0, -1):
            entry = self._most_recent(levels[depth - 1], usable)
            if entry is not None:
                return entry, depth
        return None

    def _most_recent(self, holders: str | set[str], usable: Callable[[MetaEntry], bool],
                     limit: int = 64) -> MetaEntry | None:
        keys = (holders,) if isinstance(holders, str) else holders
        best = None
        for n, key in enumerate(keys):
            if n >= limit:
                break
            entry = self._entries[key]
            if usable(entry) and (best is None or entry.timestamp > best.timestamp):
                best = entry
        return best

    # ---- protection of a chosen candidate ----

    def protect(self, key: str) -> None:
        """A request chose this entry for a restore: nothing deletes it until `unprotect`."""
        self._protected[key] = self._protected.get(key, 0) + 1

    def protected(self, key: str) -> bool:
        """Whether a request of this process chose the entry's file to restore and has not restored it yet."""
        return key in self._protected

    def unprotect(self, key: str) -> None:
        n = self._protected.get(key, 0) - 1
        if n > 0:
            self._protected[key] = n
        else:
            self._protected.pop(key, None)

    # ---- changes ----

    async def add(self, prompt: Prompt, key: str, backend: str | None, slot_save_path: str | None,
                  fingerprint: str | None, n_tokens: int | None = None, size: int | None = None,
                  worth: float | None = None) -> list[MetaEntry]:
        """Record a cache just saved as the file `key`: write its meta file, drop the entries it makes redundant
        (their identity chain is a prefix of its own, same model and folder; their history of uses carries over),
        then prune beyond the limits, the ones least likely to be needed soon for what they spare first (`worth`:
        prefill ms spared per byte, see `eviction`). Returns what was removed."""
        if slot_save_path:
            self._folders.add(slot_save_path)
        now = time.time()
        old = self._entries.get(key)
        entry = MetaEntry(key, prompt.model, self.wpb, prompt.chain, now, prompt.n_words, backend, slot_save_path,
                          prompt.exact, fingerprint, n_tokens, size or 0)
        if old is not None:
            self._unindex(old)
        removed = self._redundant(entry)
        continued = self._continued(entry, removed)
        history = [*self._ghost_of(entry, now), *(u for c in continued if (u := self._usage.get(c.key)) is not None)]
        self._insert(entry, [r.key for r in removed], history, worth or 0.0)   # it takes over their history
        self._saving.discard(key)
        for r in removed:
            self._remove(r)
        for c in continued:
            self._moved_on[c.key] = None
        removed += self._over_limit(keep=entry.key)
        data = orjson.dumps(meta_document(entry, prompt.blocks))
        if self.publish is not None:
            self.publish(entry.key, data)
        await self._delete_files(entry.key, data, removed)
        return removed

    async def saving(self, key: str, slot_save_path: str | None) -> None:
        """A prefix-mode save of `key` is about to be sent: mark it in META_DIR first (`<key>.saving`), so a stop
        before its meta file is written leaves a trace the next start reconciles (`reconcile`). When a queued I/O
        job deletes this very name, after it (one I/O thread): a save of a name the limits just deleted is never
        written while its old file is being unlinked (the server would write into a deleted file)."""
        if not valid_key(key):
            return
        if slot_save_path:
            self._folders.add(slot_save_path)
        self._saving.add(key)   # until `add` or `forget`: a deletion queued meanwhile would unlink the new file
        if key in self._unlinking:
            await self._run(self._mark, key)
        else:
            # No queued job deletes this name: the marker (an empty file, no fsync) is made at once, not behind the
            # meta files being written with an fsync (milliseconds on the way of the request whose slot this saves).
            self._mark(key)

    def unmark(self, key: str) -> None:
        """A save of `key` was given up before its answer (a shutdown): the limits may delete it again; its marker
        stays for the next start to reconcile."""
        self._saving.discard(key)

    def unsaving(self, key: str) -> None:
        """A save of `key` marked (`saving`) was given up before it was sent: the limits may delete it again, and its
        marker goes (after the file operations queued so far, without waiting for them)."""
        if not valid_key(key):
            return
        self._saving.discard(key)
        self._io.submit(_unlink, self._marker_path(key))

    def _mark(self, key: str) -> None:
        try:
            with open(self._marker_path(key), "wb"):
                pass
        except OSError as e:
            log.warning("meta_write_failed key=%s reason=%s", key, e)

    async def touch(self, key: str) -> None:
        """A restore is a use: the entry moves to the young end and its file's timestamp is bumped."""
        entry = self._entries.get(key)
        if entry is None:
            return
        self.note_use(key)
        await self._run(self._bump_file, key, entry.timestamp, entry.uses, entry.interval)

    def note_use(self, key: str) -> None:
        """The cache was used (restored, or continued in the slot that holds it): its rhythm for the replacement
        order. Written to its meta file with its next save or restore."""
        entry = self._entries.get(key)
        if entry is None:
            return
        now = time.time()
        self._usage.use(key, now)
        usage = self._usage.get(key)
        if usage is not None:
            entry.timestamp, entry.uses, entry.interval = now, usage.uses, usage.interval

    async def discard_if_stale(self, key: str) -> bool:
        """After a rejected restore: delete the meta when its KV file is gone from every visible slot-save folder,
        or the entry and the file when that file is not the size its save wrote (cut short by a server killed
        while it saved, or by a full disk; damaged since): no later restore is tried on it, and the server's KV
        layout is not blamed for it. A meta whose folders are not visible here (a remote backend) is kept: lpcache
        cannot tell."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        folders = [p for p in {entry.slot_save_path, *self.slot_save_paths} if p]

        def why_not_loadable() -> str | None:
            visible = [p for p in folders if os.path.isdir(p)]
            sizes = [size for p in visible if (size := _file_size(os.path.join(p, entry.key))) is not None]
            if visible and not sizes:
                return "stale"
            return "damaged" if entry.size and sizes and all(size != entry.size for size in sizes) else None

        why = await self._run(why_not_loadable)
        if why is None or self._entries.get(key) is not entry:
            return False
        if why == "damaged" and key in {*self._saving, *self._unlinking, *self.in_use_elsewhere()}:
            return False   # written again right now, here or by another replica: its size says nothing yet
        if why == "damaged":
            log.warning("kv_file_damaged key=%s: its file is not the %d bytes its save wrote; entry and file deleted",
                        key[:16], entry.size)
        await self.drop(key, why)
        return True

    async def drop(self, key: str, why: str) -> None:
        """Delete an entry and its files (a foreign cache the server did not reuse, a stale one)."""
        entry = self._entries.get(key)
        if entry is None:
            return
        self._remove(entry)
        self._why[key] = why
        await self._delete_files(None, b"", [entry])

    def file_present(self, entry: MetaEntry, slot_save_path: str | None) -> bool | None:
        """Whether the entry's KV file is in the folder a server reads (None: the folder is not visible here)."""
        return file_in(slot_save_path or entry.slot_save_path, entry.key)

    async def sweep_orphans(self, grace: float, before: float = math.inf) -> int:
        """Delete the files in the slot-save folders that no entry names, that nothing wrote for `grace` seconds nor
        since `before` (wall time: up to when every replica's entries are known, `fleet.synced`), and that no
        request saves or restores now (`orphans`); their number. The folders are read off the index's I/O thread."""

        def named(key: str) -> bool:
            return key in self._entries or self.named_elsewhere(key)

        found = await asyncio.to_thread(unnamed_files, sorted(self._folders), named, grace, time.time(), before)
        busy = {*self._saving, *self._protected, *self._unlinking, *self.in_use_elsewhere()}
        found = [(folder, key) for folder, key in found if not named(key) and key not in busy]
        removed: list[tuple[str, int]] = []
        if found:
            await self._tracked([key for _, key in found], remove_unnamed, found, grace, removed, before)
        self.orphans_removed += len(removed)
        return len(removed)

    async def forget(self, key: str, slot_save_path: str | None) -> None:
        """After a failed save: the server writes in place, so the file `<key>` may be partial. Drop its meta and
        the file, so nothing ever restores it (an entry of the name in another server's folder stands)."""
        entry = self._entries.get(key)
        elsewhere = entry is not None and bool(entry.slot_save_path) and entry.slot_save_path != slot_save_path
        if entry is not None and not elsewhere:
            self._remove(entry)
        self._saving.discard(key)
        if slot_save_path:
            self._folders.add(slot_save_path)

        def delete() -> None:
            if not elsewhere:
                _unlink(self._meta_path(key))
            _unlink(self._marker_path(key))
            path = inside(slot_save_path, key) if slot_save_path else None
            if path is not None and _unlink(path):
                log.info("kv_file_removed key=%s folder=%s reason=failed_save", key, slot_save_path)

        await self._tracked([key], delete)

    async def close(self) -> None:
        """Wait for the file writes already queued, then stop the worker."""
        await self._run(lambda: None)
        self._io.shutdown(wait=True)

    # ---- internals ----

    def _table(self, entry: MetaEntry) -> tuple[dict[int, str | set[str]], tuple[int, ...]] | None:
        if not entry.foreign:
            return self._exact.setdefault(entry.fingerprint or "", {}), entry.exact
        if entry.wpb != self.wpb or not entry.chain:
            return None
        return self._words.setdefault(entry.model, {}), entry.chain

    def _insert(self, entry: MetaEntry, supersedes: Sequence[str] | None = None,
                history: Sequence[Usage] = (), worth: float = 0.0) -> None:
        """Index an entry; `supersedes` None: read back at start (its history is in its meta file)."""
        self._entries[entry.key] = entry
        if supersedes is None:
            self._usage.load(entry.key, entry.size, entry.timestamp, entry.interval, entry.uses)
        else:
            usage = self._usage.add(entry.key, entry.size, entry.timestamp, supersedes, history, worth)
            entry.uses, entry.interval = usage.uses, usage.interval
        found = self._table(entry)
        if found is None:
            return
        table, chain_ = found
        for digest in chain_:
            add_holder(table, digest, entry.key)
        if not entry.foreign:
            add_holder(self._ends.setdefault(entry.fingerprint or "", {}), entry.exact[-1], entry.key)

    def _remove(self, entry: MetaEntry) -> None:
        if self._entries.get(entry.key) is not entry:
            return
        self._usage.remove(entry.key)
        self._unindex(entry)
        if self.publish is not None and not self._applying:
            self.publish(entry.key, None)

    # ---- shared with other replicas (REDIS_URL: `fleet`) ----

    def apply(self, key: str, document: bytes | None) -> None:
        """Another replica added (its meta document) or removed (None) an entry: the lookup tables follow. Files are
        never deleted for it (the replica that removed the entry deleted them); this replica's meta file of it, if
        any, goes, so a restart does not bring the entry back."""
        self._applying = True
        try:
            old = self._entries.get(key)
            if document is None:
                if old is not None and key not in self._saving:
                    self._remove(old)
                    self._io.submit(_unlink, self._meta_path(key))
                return
            try:
                entry = entry_from_document(key, orjson.loads(document))
            except ValueError as e:
                log.warning("meta_skipped shared key=%s reason=%s", key, e)
                return
            if entry.slot_save_path:
                self._folders.add(entry.slot_save_path)
            if old is not None:
                self._unindex(old)
            self._insert(entry)
        finally:
            self._applying = False

    def overwritten(self, key: str) -> None:
        """A save is about to write over the file `key` (a ring name, `saving.Saver.file_name`): its entry goes
        (told to the other replicas), its file stays for the save to replace."""
        entry = self._entries.get(key)
        if entry is not None:
            self._remove(entry)
            self._io.submit(_unlink, self._meta_path(key))

    def document(self, key: str) -> bytes | None:
        """The meta document of an entry, as its meta file has it (None: no entry, or no file here)."""
        if key not in self._entries:
            return None
        try:
            return read_regular(self._meta_path(key))
        except OSError:
            return None

    def documents(self) -> list[tuple[str, bytes]]:
        """The meta documents of every entry whose meta file is in META_DIR (blocking: run it in a thread)."""
        return [(key, doc) for key in list(self._entries) if (doc := self.document(key)) is not None]

    def _unindex(self, entry: MetaEntry) -> None:
        """Out of the lookup tables and the entry list (its usage record stays: an entry saved again under the
        same name keeps its history)."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._moved_on.pop(entry.key, None)
        found = self._table(entry)
        if found is None:
            return
        table, chain_ = found
        for digest in chain_:
            drop_holder(table, digest, entry.key)
        if not entry.foreign:
            drop_holder(self._ends.get(entry.fingerprint or "", {}), entry.exact[-1], entry.key)


def _named_nowhere(key: str) -> bool:
    return False


def _file_size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None
