"""The saved session caches of one route in a slot-save folder, and their limits.

A route's files are `<route tag>_<32 hex>.bin` (see `sessions.session_filename`); nothing else in the folder is
counted or touched, so other routes, prefix-mode caches and foreign files are safe. The age of a file is its
modification time: a save rewrites it and a restore renews it (`touch`), so "used longest ago" is the oldest.
Blocking file calls: the async callers run these on a worker thread.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger("lpcache.cache_files")

GIB = 1024 ** 3


@dataclass(frozen=True, slots=True)
class Limits:
    """0 means no limit."""

    max_files: int = 0
    max_bytes: int = 0

    @classmethod
    def of(cls, max_files: int, max_gib: float) -> Limits:
        return cls(max_files, int(max_gib * GIB))

    def __bool__(self) -> bool:
        return bool(self.max_files or self.max_bytes)


@dataclass(frozen=True, slots=True)
class CacheFile:
    name: str
    size: int
    mtime: float


class CacheFolder:
    """The files of one route (`tag`) in `path`, the folder of llama-server's --slot-save-path as lpcache sees it
    (None: not visible here; then nothing is checked, touched or deleted)."""

    def __init__(self, path: str | None, tag: str, limits: Limits = Limits()) -> None:
        self.path = path
        self.tag = tag
        self.limits = limits
        self._files = re.compile(re.escape(tag) + r"_[0-9a-f]{32}\.bin")

    def owns(self, name: str) -> bool:
        return self._files.fullmatch(name) is not None

    def has(self, name: str) -> bool | None:
        """Whether the file is there; None when the folder is not visible (try the restore, a miss is cheap)."""
        if not self.path:
            return None
        return os.path.isfile(os.path.join(self.path, name))

    def size(self, name: str) -> int | None:
        found = self.stat(name)
        return None if found is None else found[1]

    def stat(self, name: str) -> tuple[float, int] | None:
        """(modification time, size) of the file; None when it is not there or the folder is not visible."""
        if not self.path:
            return None
        try:
            st = os.stat(os.path.join(self.path, name))
        except OSError:
            return None
        return st.st_mtime, st.st_size

    def touch(self, name: str) -> None:
        """A restored cache was just used: it is the last of its route to be deleted."""
        if self.path and self.owns(name):
            try:
                os.utime(os.path.join(self.path, name))
            except OSError:
                pass

    def files(self) -> list[CacheFile]:
        """The route's files, used longest ago first."""
        if not self.path:
            return []
        found = []
        try:
            with os.scandir(self.path) as entries:
                for entry in entries:
                    if self.owns(entry.name):
                        try:
                            st = entry.stat()
                        except OSError:
                            continue  # deleted meanwhile
                        found.append(CacheFile(entry.name, st.st_size, st.st_mtime))
        except OSError as e:
            log.warning("cache_folder_unreadable path=%s error=%s", self.path, e)
            return []
        found.sort(key=lambda f: (f.mtime, f.name))
        return found

    def enforce(self, keep: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Delete the route's files used longest ago until the limits hold, never those named in `keep` (the one
        just saved, the one about to be restored). Returns the names deleted."""
        if not self.limits or not self.path:
            return []
        files = self.files()
        count, total = len(files), sum(f.size for f in files)
        removed = []
        for f in files:
            over_count = self.limits.max_files and count > self.limits.max_files
            over_size = self.limits.max_bytes and total > self.limits.max_bytes
            if not (over_count or over_size):
                break
            if f.name in keep:
                continue
            try:
                os.remove(os.path.join(self.path, f.name))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cache_file_not_deleted name=%s error=%s", f.name, e)
                continue
            count, total = count - 1, total - f.size
            removed.append(f.name)
            log.info("cache_file_deleted name=%s bytes=%d reason=limit", f.name, f.size)
        if self.limits.max_bytes and total > self.limits.max_bytes:
            log.warning("cache_over_limit route_tag=%s bytes=%d max_bytes=%d: the caches kept (the one just saved, "
                        "the one being restored) are larger than MAX_GIB alone", self.tag, total,
                        self.limits.max_bytes)
        return removed
