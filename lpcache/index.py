"""The saved caches: `<key>.meta.json` files in META_DIR, and an in-memory index over them.

The Rust lpcache scans META_DIR on every big request. Here the files are read once, at start, and the index is kept
current on every save, restore and prune, so finding the saved cache that shares the longest prefix with a prompt
costs one dict lookup per block of the prompt, whatever the number of entries.

An entry lpcache wrote knows exactly what its file holds (the prompt's identity chain, `identity`) and which model
made it (the server's fingerprint): it is found by that chain, among the entries of the fingerprints that can serve
the request, and never offered to another model. An entry from the Rust lpcache or proxycache knows only its word
blocks and client model name: it is found by words, tried, and judged by what the server reports afterwards.

An entry chosen for a restore is protected until the restore is done: neither a newer save that supersedes it nor
the limits (META_MAX, META_MAX_GIB) delete it meanwhile.

File writes are atomic (a temporary file, then a rename) and go through one worker thread, in order, so a write
and a delete of the same key never race and the event loop never waits on the disk.

Keys are file names: only 64 lower-case hex digits (lpcache's and the Rust lpcache's SHA-256 keys) are read or
written, and a KV file is only ever looked for or deleted inside the slot-save folders lpcache was given, whatever
a meta file says (a stray or hostile meta file can neither name another file nor point into another folder).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import orjson

from .errors import ConfigError
from .eviction import Usage, UsageTable
from .prefix import Prompt, chain

log = logging.getLogger("lpcache.index")
T = TypeVar("T")

META_SUFFIX = ".meta.json"
MOVED_ON_TAIL = (4, 0.1)   # an entry a new save shares all but this many identity blocks (or share) of has moved on
META_FILE_MAX_BYTES = 64 * 1024 * 1024   # a meta file larger than this is not lpcache's (a 128k-token prompt: ~0.3 MB)
MARKER_SUFFIX = ".saving"                # `<key>.saving`: a save announced, its meta file not written yet
SKIPPED_LOGGED = 20                      # `meta_skipped` lines at start; the rest are counted in one line
_KEY = re.compile(r"[0-9a-f]{64}")
_TMP = re.compile(r"[0-9a-f]{64}\.meta\.json\.tmp-[0-9]+")
GHOSTS_MIN = 1024   # usage records of deleted entries kept (at least; 4 x META_MAX when that is more)
FORMAT_VERSION = 1


@dataclass(slots=True)
class MetaEntry:
    """One saved cache: the KV file `<key>` in `slot_save_path` of `backend`, described by its word-block chain
    (lookup) and, when lpcache wrote it, its exact identity chain and the fingerprint of the model that made it."""

    key: str
    model: str
    wpb: int
    chain: tuple[int, ...]
    timestamp: float
    n_words: int = 0
    backend: str | None = None
    slot_save_path: str | None = None
    exact: tuple[int, ...] = ()
    fingerprint: str | None = None
    n_tokens: int | None = None    # tokens the file holds (the save's n_saved)
    size: int = 0                  # bytes of the file (the save's n_written; 0: unknown)
    uses: int = 1                  # uses of this conversation (inherited from the files it replaced), for ...
    interval: float | None = None  # ... the replacement order (`eviction`): kept in the meta file across restarts

    @property
    def foreign(self) -> bool:
        """Written by the Rust lpcache or proxycache (or an older lpcache): no exact chain, no model identity."""
        return not self.exact or self.fingerprint is None

    def readable_by(self, url: str, slot_save_path: str | None) -> bool:
        """A KV file is readable by a server that uses the same slot-save folder, or by the server that wrote it. A
        meta file that says neither (written by the Rust lpcache or proxycache, which had one folder) is tried on
        any server: a miss only costs a prefill."""
        if self.slot_save_path and slot_save_path:
            return self.slot_save_path == slot_save_path
        if self.backend is None and self.slot_save_path is None:
            return True
        return self.backend == url


@dataclass(frozen=True, slots=True)
class Candidate:
    """A saved cache worth restoring for a prompt: it shares `shared` identity blocks with it from the start, exactly
    (`exact`), or, for a foreign entry, as far as its word blocks tell (converted to identity blocks)."""

    entry: MetaEntry
    shared: int
    ratio: float
    exact: bool = True


def prefix_file(key: str, fingerprint: str) -> str:
    """The file name of a prefix cache: the request's key and the model that made it (two models sharing one
    slot-save folder never write the same name)."""
    return hashlib.sha256(f"{fingerprint}\n{key}".encode()).hexdigest()


def meta_document(entry: MetaEntry, blocks: Sequence[str]) -> dict:
    """The JSON of a meta file: the Rust lpcache's fields (block hashes, model id, words per block, timestamp), where
    the KV file is, and what it exactly holds and which model made it."""
    return {
        "version": FORMAT_VERSION,
        "key": entry.key,
        "model_id": entry.model,
        "wpb": entry.wpb,
        "blocks": list(blocks),
        "n_words": entry.n_words,
        "timestamp": entry.timestamp,
        "backend": entry.backend,
        "slot_save_path": entry.slot_save_path,
        "exact": [f"{d:016x}" for d in entry.exact],
        "fingerprint": entry.fingerprint,
        "n_tokens": entry.n_tokens,
        "bytes": entry.size,
        "uses": entry.uses,
        "interval": entry.interval,
    }


def valid_key(key: object) -> bool:
    """A cache key, and so a file name: exactly 64 lower-case hex digits (a SHA-256), never a path."""
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def inside(folder: str, name: str) -> str | None:
    """`folder/name` when `name` is a plain file name that stays in `folder`; None for anything else (a separator,
    `..`, an empty name): no path built from a key or a file name ever leaves its folder."""
    if not name or name in (".", "..") or any(c in name for c in ("/", "\\", "\0")):
        return None
    return os.path.join(folder, name)


def check_meta_dir(meta_dir: str) -> None:
    """Create META_DIR when missing; raises ConfigError (one clear line, exit status 2) when it cannot be created,
    is not a folder, or cannot be listed and written."""
    try:
        os.makedirs(meta_dir, exist_ok=True)
    except FileExistsError:
        raise ConfigError("META_DIR", f"{meta_dir!r} exists and is not a folder") from None
    except OSError as e:
        raise ConfigError("META_DIR", f"cannot create {meta_dir!r}: {e.strerror or e}") from None
    if not os.path.isdir(meta_dir):
        raise ConfigError("META_DIR", f"{meta_dir!r} is not a folder")
    if not os.access(meta_dir, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError("META_DIR", f"{meta_dir!r} is not readable and writable by this user")


def read_regular(path: str, limit: int = META_FILE_MAX_BYTES) -> bytes:
    """The bytes of a regular file; OSError for anything else (a FIFO, a device, a folder: never blocks on one) or
    a file larger than `limit`."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError("not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))   # swapped for a FIFO since the stat: no hang
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file")
        if st.st_size > limit:
            raise OSError(f"larger than {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def entry_from_document(key: str, doc: object) -> MetaEntry:
    """Checks a meta file's JSON; raises ValueError for anything lpcache did not write."""
    if not valid_key(key):
        raise ValueError("the key (file name) is not 64 lower-case hex digits")
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    model = doc.get("model_id", doc.get("model"))
    wpb = doc.get("wpb")
    blocks = doc.get("blocks")
    timestamp = doc.get("timestamp", 0.0)
    if not isinstance(model, str) or not isinstance(wpb, int) or wpb < 1:
        raise ValueError("no model_id or wpb")
    if not isinstance(blocks, list) or not all(isinstance(b, str) and len(b) == 64 for b in blocks):
        raise ValueError("blocks is not a list of SHA-256 hex digests")
    if not isinstance(timestamp, int | float):
        raise ValueError("timestamp is not a number")
    n_words = doc.get("n_words", 0)
    if not isinstance(n_words, int):
        raise ValueError("n_words is not an integer")
    backend = doc.get("backend")
    path = doc.get("slot_save_path")
    exact = doc.get("exact", [])
    if not isinstance(exact, list) or not all(isinstance(d, str) and len(d) == 16 for d in exact):
        raise ValueError("exact is not a list of 64-bit hex digests")
    fingerprint, n_tokens, size = doc.get("fingerprint"), doc.get("n_tokens"), doc.get("bytes", 0)
    uses, interval = doc.get("uses", 1), doc.get("interval")
    return MetaEntry(
        key=key, model=model, wpb=wpb, chain=chain(blocks), timestamp=float(timestamp), n_words=n_words,
        backend=backend if isinstance(backend, str) else None,
        slot_save_path=path if isinstance(path, str) else None,
        exact=tuple(int(d, 16) for d in exact),
        fingerprint=fingerprint if isinstance(fingerprint, str) else None,
        n_tokens=n_tokens if isinstance(n_tokens, int) else None,
        size=size if isinstance(size, int) and size > 0 else 0,
        uses=uses if isinstance(uses, int) and uses > 0 else 1,
        interval=float(interval) if isinstance(interval, int | float) and interval > 0 else None,
    )


def write_atomic(path: str, data: bytes) -> None:
    """Write a file so that readers see the old content or the new, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unlink_regular(path: str) -> bool:
    """Delete a file only when it is a regular one (never a folder, FIFO, device or symbolic link)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    return _unlink(path)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("cannot delete %s: %s", path, e)
        return False


class MetaIndex:
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
        # With REDIS_URL (`fleet.Fleet.files_in_use`): the files other replicas' requests restore or save now.
        self.in_use_elsewhere: Callable[[], Collection[str]] = tuple
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
        - Any other file, including a 64-hex-digit one with neither meta file nor marker (the Rust lpcache names
          its files the same way, and earlier lpcache versions left no marker), is not provably lpcache's: it is
          never deleted, only counted in one line (`kv_files_unknown`).
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
                         "meta file describes (the Rust lpcache's, or left by an older lpcache) are left alone",
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
        levels = _levels(table, chain)
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
        """After a rejected restore: delete the meta when its KV file is gone from every visible slot-save folder.
        A meta whose folders are not visible here (a remote backend) is kept: lpcache cannot tell."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        folders = [p for p in {entry.slot_save_path, *self.slot_save_paths} if p]

        def gone_everywhere() -> bool:
            visible = [p for p in folders if os.path.isdir(p)]
            return bool(visible) and not any(os.path.exists(os.path.join(p, entry.key)) for p in visible)

        if not await self._run(gone_everywhere) or self._entries.get(key) is not entry:
            return False
        await self.drop(key, "stale")
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
        folder = slot_save_path or entry.slot_save_path
        if not folder or not os.path.isdir(folder):
            return None
        path = inside(folder, entry.key)
        return path is not None and os.path.isfile(path)

    async def forget(self, key: str, slot_save_path: str | None) -> None:
        """After a failed save: the server writes in place, so the file `<key>` may be partial. Drop its meta and
        the file, so nothing ever restores it."""
        entry = self._entries.get(key)
        if entry is not None:
            self._remove(entry)
        self._saving.discard(key)
        if slot_save_path:
            self._folders.add(slot_save_path)

        def delete() -> None:
            _unlink(self._meta_path(key))
            _unlink(self._marker_path(key))
            path = inside(slot_save_path, key) if slot_save_path else None
            if path is not None and _unlink(path):
                log.info("kv_file_removed key=%s folder=%s reason=failed_save", key, slot_save_path)

        await self._tracked([key], delete)

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

    async def close(self) -> None:
        """Wait for the file writes already queued, then stop the worker."""
        await self._run(lambda: None)
        self._io.shutdown(wait=True)

    # ---- internals ----

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
        3. the rest, by the replacement order (`eviction`): the one needed furthest in the future first.
        """
        in_use = self.files_in_use()
        spare = {keep, *in_use}
        removed = self._evict_among(list(self._moved_on), spare, "moved_on")
        # the entry just saved too, when a slot has it
        removed += self._evict_among(self.held(), in_use, "in_slot")
        if self.over():
            count, size = self._limits()
            for key in self._usage.victims(time.time(), count, size, spare):
                entry = self._entries.get(key)
                if entry is not None:
                    self._evict_entry(entry, "limit")
                    removed.append(entry)
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
        levels = _levels(table, chain)
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
            _add_holder(table, digest, entry.key)
        if not entry.foreign:
            _add_holder(self._ends.setdefault(entry.fingerprint or "", {}), entry.exact[-1], entry.key)

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
            _drop_holder(table, digest, entry.key)
        if not entry.foreign:
            _drop_holder(self._ends.get(entry.fingerprint or "", {}), entry.exact[-1], entry.key)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _delete_files(self, key: str | None, data: bytes, removed: list[MetaEntry]) -> None:
        await self._tracked([e.key for e in removed], self._write_and_delete, key, data, removed)

    async def _tracked(self, keys: list[str], fn: Callable[..., None], *args: object) -> None:
        """Run an I/O job that deletes the files of `keys`, counted in `_unlinking` until it has run (a marker of
        one of those names waits for it: `saving`), even when the caller is cancelled meanwhile."""
        for key in keys:
            self._unlinking[key] = self._unlinking.get(key, 0) + 1
        job = asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

        def done(_: object) -> None:
            for key in keys:
                left = self._unlinking.get(key, 0) - 1
                if left > 0:
                    self._unlinking[key] = left
                else:
                    self._unlinking.pop(key, None)

        job.add_done_callback(done)
        await asyncio.shield(job)

    def _meta_path(self, key: str) -> str:
        return os.path.join(self.meta_dir, key + META_SUFFIX)

    def _marker_path(self, key: str) -> str:
        return os.path.join(self.meta_dir, key + MARKER_SUFFIX)

    def _kv_paths(self, entry: MetaEntry) -> list[tuple[str, str]]:
        """(folder, path) of the entry's KV file in each folder it may be in that lpcache may delete in."""
        found = []
        for folder in {entry.slot_save_path, *self.slot_save_paths}:
            path = inside(folder, entry.key) if folder and folder in self._folders else None
            if folder and path is not None:
                found.append((folder, path))
        return found

    def _write_and_delete(self, key: str | None, data: bytes, removed: list[MetaEntry]) -> None:
        """Delete the files of `removed`, then write `key`'s meta file (with an fsync) and drop its marker. The
        deletions come first: they make the room the new file takes (the disk bound), and a stop before the meta
        file is written leaves the marker, from which the next start deletes the unrecorded file."""
        for entry in removed:
            why = self._why.pop(entry.key, "redundant")
            if entry.key in self._entries:
                continue   # saved again meanwhile (same name): its new file and meta stay
            _unlink(self._meta_path(entry.key))
            for folder, path in self._kv_paths(entry):
                if _unlink(path):
                    log.debug("kv_file_removed key=%s folder=%s", entry.key, folder)
            log.info("meta_removed key=%s reason=%s", entry.key, why)
        if key is not None:
            try:
                os.makedirs(self.meta_dir, exist_ok=True)
                write_atomic(self._meta_path(key), data)
            except OSError as e:
                log.warning("meta_write_failed key=%s reason=%s", key, e)
            _unlink(self._marker_path(key))   # recorded (or not: the file is then unknown, never deleted)

    def _bump_file(self, key: str, timestamp: float, uses: int, interval: float | None) -> None:
        path = self._meta_path(key)
        try:
            with open(path, "rb") as f:
                doc = orjson.loads(f.read())
            doc["timestamp"], doc["uses"], doc["interval"] = timestamp, uses, interval
            write_atomic(path, orjson.dumps(doc))
        except FileNotFoundError:
            pass   # another replica's entry (REDIS_URL): its meta file is in that replica's META_DIR
        except (OSError, ValueError, TypeError) as e:
            log.warning("meta_touch_failed key=%s reason=%s", key, e)


def _levels(table: dict[int, str | set[str]], chain: Sequence[int]) -> list[str | set[str]]:
    """The holders of each block of `chain` in a lookup table, from the first, while the table has them: level i
    holds the entries sharing the chain's first i+1 blocks."""
    levels: list[str | set[str]] = []
    for digest in chain:
        holders = table.get(digest)
        if holders is None:
            break
        levels.append(holders)
    return levels


def _add_holder(table: dict[int, str | set[str]], digest: int, key: str) -> None:
    holders = table.get(digest)
    if holders is None:
        table[digest] = key
    elif isinstance(holders, str):
        if holders != key:
            table[digest] = {holders, key}
    else:
        holders.add(key)


def _drop_holder(table: dict[int, str | set[str]], digest: int, key: str) -> None:
    holders = table.get(digest)
    if holders is None:
        return
    if isinstance(holders, str):
        if holders == key:
            del table[digest]
        return
    holders.discard(key)
    if len(holders) == 1:
        table[digest] = next(iter(holders))
    elif not holders:
        del table[digest]
