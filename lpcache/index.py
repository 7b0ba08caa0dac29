"""The saved caches: `<key>.meta.json` files in META_DIR, and an in-memory index over them.

The Rust lpcache scans META_DIR on every big request. Here the files are read once, at start, and the index is kept
current on every save, restore and prune, so finding the saved cache that shares the longest prefix with a prompt
costs one dict lookup per block of the prompt, whatever the number of entries.

File writes are atomic (a temporary file, then a rename) and go through one worker thread, in order, so a write
and a delete of the same key never race and the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import orjson

from .prefix import Prompt, chain

log = logging.getLogger("lpcache.index")
T = TypeVar("T")

META_SUFFIX = ".meta.json"
FORMAT_VERSION = 1


@dataclass(slots=True)
class MetaEntry:
    """One saved cache: the KV file `<key>` in `slot_save_path` of `backend`, described by its block chain."""

    key: str
    model: str
    wpb: int
    chain: tuple[int, ...]
    timestamp: float
    n_words: int = 0
    backend: str | None = None
    slot_save_path: str | None = None

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
    """A saved cache worth restoring for a prompt: it shares `shared` whole blocks with it from the start."""

    entry: MetaEntry
    shared: int
    ratio: float


def meta_document(prompt: Prompt, wpb: int, timestamp: float, backend: str | None,
                  slot_save_path: str | None) -> dict:
    """The JSON of a meta file: block hashes, model id, words per block, timestamp, and where the KV file is."""
    return {
        "version": FORMAT_VERSION,
        "key": prompt.key,
        "model_id": prompt.model,
        "wpb": wpb,
        "blocks": list(prompt.blocks),
        "n_words": prompt.n_words,
        "timestamp": timestamp,
        "backend": backend,
        "slot_save_path": slot_save_path,
    }


def entry_from_document(key: str, doc: object) -> MetaEntry:
    """Checks a meta file's JSON; raises ValueError for anything lpcache did not write."""
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
    return MetaEntry(
        key=key, model=model, wpb=wpb, chain=chain(blocks), timestamp=float(timestamp), n_words=n_words,
        backend=backend if isinstance(backend, str) else None,
        slot_save_path=path if isinstance(path, str) else None,
    )


def write_atomic(path: str, data: bytes) -> None:
    """Write a file so that readers see the old content or the new, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    """Meta files on disk, their LRU order, and a prefix index for restore lookups.

    `_prefixes[model][chain[i]]` holds the key (or the set of keys) of the entries whose first i+1 blocks are those
    of that chain digest; `_ends` the same for entries whose chain ends there, to find entries a new save makes
    redundant.
    """

    def __init__(self, meta_dir: str, words_per_block: int, meta_max: int,
                 slot_save_paths: Iterable[str] = ()) -> None:
        self.meta_dir = meta_dir
        self.wpb = words_per_block
        self.meta_max = meta_max
        self.slot_save_paths = tuple(slot_save_paths)
        self._entries: OrderedDict[str, MetaEntry] = OrderedDict()  # least recently used first
        self._prefixes: dict[str, dict[int, str | set[str]]] = {}
        self._ends: dict[str, dict[int, str | set[str]]] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpcache-meta")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> MetaEntry | None:
        return self._entries.get(key)

    # ---- start-up ----

    def load(self) -> int:
        """Read every meta file; skip corrupt or foreign ones with a warning. Returns the number loaded."""
        os.makedirs(self.meta_dir, exist_ok=True)
        loaded = []
        for name in os.listdir(self.meta_dir):
            path = os.path.join(self.meta_dir, name)
            if ".meta.json.tmp-" in name:
                _unlink(path)  # a write that never finished
                continue
            if not name.endswith(META_SUFFIX):
                continue
            key = name[: -len(META_SUFFIX)]
            try:
                with open(path, "rb") as f:
                    loaded.append(entry_from_document(key, orjson.loads(f.read())))
            except (OSError, ValueError) as e:
                log.warning("meta_skipped file=%s reason=%s", path, e)
        for entry in sorted(loaded, key=lambda e: e.timestamp):
            self._insert(entry)
        return len(loaded)

    # ---- lookups ----

    def find(self, prompt: Prompt, usable: Callable[[MetaEntry], bool] = lambda e: True,
             threshold: float = 0.0) -> Candidate | None:
        """The usable entry sharing the most whole blocks with the prompt, if its share reaches `threshold`.

        Longest shared prefix wins, not the highest ratio: a cached system prompt alone must not beat a long
        conversation. Cost: one dict lookup per shared block, plus the entries tied at the deepest level.
        """
        prefixes = self._prefixes.get(prompt.model)
        if not prefixes or not prompt.chain:
            return None
        levels: list[str | set[str]] = []
        for digest in prompt.chain:
            holders = prefixes.get(digest)
            if holders is None:
                break
            levels.append(holders)
        total = len(prompt.chain)
        for depth in range(len(levels), 0, -1):
            if depth / total < threshold:
                return None
            best = self._most_recent(levels[depth - 1], usable)
            if best is not None:
                return Candidate(best, depth, depth / total)
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

    # ---- changes ----

    async def add(self, prompt: Prompt, backend: str | None, slot_save_path: str | None) -> list[MetaEntry]:
        """Record a cache just saved as `<key>`: write its meta file, drop the entries it makes redundant (their
        chain is a prefix of its own, in the same folder), then prune beyond META_MAX. Returns what was removed."""
        now = time.time()
        doc = meta_document(prompt, self.wpb, now, backend, slot_save_path)
        old = self._entries.get(prompt.key)
        if old is not None:
            self._remove(old)
        entry = MetaEntry(prompt.key, prompt.model, self.wpb, prompt.chain, now, prompt.n_words,
                          backend, slot_save_path)
        removed = self._redundant(entry)
        for r in removed:
            self._remove(r)
        self._insert(entry)
        removed += self._over_limit(keep=entry.key)
        data = orjson.dumps(doc)
        await self._run(self._write_and_delete, entry.key, data, removed)
        return removed

    async def touch(self, key: str) -> None:
        """A restore is a use: the entry moves to the young end of the LRU and its file's timestamp is bumped."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.timestamp = time.time()
        self._entries.move_to_end(key)
        await self._run(self._bump_file, key, entry.timestamp)

    async def discard_if_stale(self, key: str) -> bool:
        """After a rejected restore: delete the meta when its KV file is gone from every visible slot-save folder.
        A meta whose folders are not visible here (a remote backend) is kept: lpcache cannot tell."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        folders = [p for p in {entry.slot_save_path, *self.slot_save_paths} if p]

        def gone_everywhere() -> bool:
            visible = [p for p in folders if os.path.isdir(p)]
            return bool(visible) and not any(os.path.exists(os.path.join(p, key)) for p in visible)

        if not await self._run(gone_everywhere) or self._entries.get(key) is not entry:
            return False
        self._remove(entry)
        await self._run(self._write_and_delete, None, b"", [entry])
        log.info("meta_stale_removed key=%s", key)
        return True

    async def forget(self, key: str, slot_save_path: str | None) -> None:
        """After a failed save: the server writes in place, so the file `<key>` may be partial. Drop its meta and
        the file, so nothing ever restores it."""
        entry = self._entries.get(key)
        if entry is not None:
            self._remove(entry)

        def delete() -> None:
            _unlink(self._meta_path(key))
            if slot_save_path and _unlink(os.path.join(slot_save_path, key)):
                log.info("kv_file_removed key=%s folder=%s reason=failed_save", key, slot_save_path)

        await self._run(delete)

    def disk_bytes(self, limit: int = 10000) -> int | None:
        """The size of the KV files of the entries (in the folders visible here): the disk the caches use.
        None when no folder is visible; at most `limit` files are looked at."""
        total, seen = 0, False
        for n, entry in enumerate(reversed(self._entries.values())):
            if n >= limit:
                break
            for folder in {entry.slot_save_path, *self.slot_save_paths}:
                if folder:
                    try:
                        total += os.stat(os.path.join(folder, entry.key)).st_size
                        seen = True
                        break
                    except OSError:
                        continue
        return total if seen or not self._entries else None

    async def close(self) -> None:
        """Wait for the file writes already queued, then stop the worker."""
        await self._run(lambda: None)
        self._io.shutdown(wait=True)

    # ---- internals ----

    def _redundant(self, new: MetaEntry) -> list[MetaEntry]:
        ends = self._ends.get(new.model, {})
        found = []
        for digest in new.chain:
            holders = ends.get(digest)
            if holders is None:
                continue
            for key in ((holders,) if isinstance(holders, str) else tuple(holders)):
                e = self._entries[key]
                if e.key != new.key and e.slot_save_path == new.slot_save_path and e.backend == new.backend:
                    found.append(e)
        return found

    def _over_limit(self, keep: str) -> list[MetaEntry]:
        removed: list[MetaEntry] = []
        if self.meta_max <= 0:
            return removed
        while len(self._entries) > self.meta_max:
            oldest = next(iter(self._entries.values()))
            if oldest.key == keep:
                break
            self._remove(oldest)
            removed.append(oldest)
        return removed

    def _insert(self, entry: MetaEntry) -> None:
        self._entries[entry.key] = entry
        self._entries.move_to_end(entry.key)
        if entry.wpb != self.wpb or not entry.chain:
            return
        prefixes = self._prefixes.setdefault(entry.model, {})
        for digest in entry.chain:
            _add_holder(prefixes, digest, entry.key)
        _add_holder(self._ends.setdefault(entry.model, {}), entry.chain[-1], entry.key)

    def _remove(self, entry: MetaEntry) -> None:
        if self._entries.pop(entry.key, None) is None:
            return
        if entry.wpb != self.wpb or not entry.chain:
            return
        prefixes = self._prefixes.get(entry.model, {})
        for digest in entry.chain:
            _drop_holder(prefixes, digest, entry.key)
        _drop_holder(self._ends.get(entry.model, {}), entry.chain[-1], entry.key)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def _meta_path(self, key: str) -> str:
        return os.path.join(self.meta_dir, key + META_SUFFIX)

    def _write_and_delete(self, key: str | None, data: bytes, removed: list[MetaEntry]) -> None:
        if key is not None:
            try:
                os.makedirs(self.meta_dir, exist_ok=True)
                write_atomic(self._meta_path(key), data)
            except OSError as e:
                log.warning("meta_write_failed key=%s reason=%s", key, e)
        for entry in removed:
            _unlink(self._meta_path(entry.key))
            for folder in {entry.slot_save_path, *self.slot_save_paths}:
                if folder and _unlink(os.path.join(folder, entry.key)):
                    log.debug("kv_file_removed key=%s folder=%s", entry.key, folder)
            log.info("meta_removed key=%s", entry.key)

    def _bump_file(self, key: str, timestamp: float) -> None:
        path = self._meta_path(key)
        try:
            with open(path, "rb") as f:
                doc = orjson.loads(f.read())
            doc["timestamp"] = timestamp
            write_atomic(path, orjson.dumps(doc))
        except (OSError, ValueError, TypeError) as e:
            log.warning("meta_touch_failed key=%s reason=%s", key, e)


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
