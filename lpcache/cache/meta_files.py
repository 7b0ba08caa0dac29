"""The index's files: `<key>.meta.json` in META_DIR, and the KV files they describe in the slot-save folders.

Keys are file names: only 64 lower-case hex digits (lpcache's and the Rust lpcache's SHA-256 keys) are read or
written, and a KV file is only ever looked for or deleted inside the slot-save folders lpcache was given, whatever
a meta file says (a stray or hostile meta file can neither name another file nor point into another folder).

File writes are atomic (a temporary file, then a rename) and go through one worker thread, in order (`MetaFiles`),
so a write and a delete of the same key never race and the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import orjson

from lpcache.cache.prefix import chain
from lpcache.errors import ConfigError

log = logging.getLogger("lpcache.index")
T = TypeVar("T")

META_SUFFIX = ".meta.json"
META_FILE_MAX_BYTES = 64 * 1024 * 1024   # a meta file larger than this is not lpcache's (a 128k-token prompt: ~0.3 MB)
MARKER_SUFFIX = ".saving"                # `<key>.saving`: a save announced, its meta file not written yet
_KEY = re.compile(r"[0-9a-f]{64}")
_TMP = re.compile(r"[0-9a-f]{64}\.meta\.json\.tmp-[0-9]+")
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


def file_in(folder: str | None, name: str) -> bool | None:
    """Whether the KV file `name` is in a slot-save folder; None when that folder is not visible here (lpcache on
    another host than the server): then the restore is tried, and a miss is cheap."""
    if not folder or not os.path.isdir(folder):
        return None
    path = inside(folder, name)
    return path is not None and os.path.isfile(path)


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


class MetaFiles:
    """The index's file I/O, on its one worker thread (`MetaIndex` is one): meta files written and bumped, the files
    of removed entries deleted, each deletion counted until it has run."""

    meta_dir: str
    slot_save_paths: tuple[str, ...]
    _folders: set[str]
    _entries: dict[str, MetaEntry]
    _unlinking: dict[str, int]
    _why: dict[str, str]
    _io: ThreadPoolExecutor

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
