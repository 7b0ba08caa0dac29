"""Cache files no index names: deleted once nothing wrote them for a grace period.

A prefix cache's KV file is named by its key, and its meta file (this replica's, or with REDIS_URL any replica's,
mirrored into the index) names it. A file nothing names is counted by no limit (META_MAX, META_MAX_GIB), and
crashes leave such files: a replica killed between the server's write and its meta file whose marker is lost with
it (another host's META_DIR, a Kubernetes `emptyDir`), or Redis losing the entries of a replica that is gone. So
every ORPHAN_GRACE_SECONDS / 4 (at least SWEEP_MIN_SECONDS) the slot-save folders lpcache sees are scanned: a file
named like a prefix cache (64 hex digits) that no index entry names, whose save no request of any replica has under
way (`MetaIndex.saving`, `files_in_use`), and that nothing wrote for ORPHAN_GRACE_SECONDS is deleted
(`kv_file_removed ... reason=orphan`, `lpcache_orphan_files_removed_total`). Session files are the session
limits' (MAX_FILES, MAX_GIB); a file of a meta file the Rust lpcache wrote is named by it. With Redis, a file is
judged only when written before every replica was last known to have published its entries (`fleet.synced`): a
replica cut off from Redis names its new files only locally, and while this replica is cut off or behind, or Redis
lost its data less than a grace period ago, there is no sweep. ORPHAN_GRACE_SECONDS=0: no sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable

from lpcache.cache.meta_files import valid_key

log = logging.getLogger("lpcache.orphans")

SWEEP_MIN_SECONDS = 30.0


def unnamed_files(folders: Iterable[str], named: Callable[[str], bool], grace: float, now: float,
                  before: float = math.inf) -> list[tuple[str, str]]:
    """(folder, name) of the regular files named like a prefix cache in `folders` that `named` does not know and
    nothing wrote for `grace` seconds nor since `before` (by their mtime against `now`, wall clock). A folder
    lpcache cannot read is passed over."""
    found = []
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if not valid_key(e.name) or named(e.name) or not e.is_file(follow_symlinks=False):
                        continue
                    with contextlib.suppress(OSError):
                        if untouched(e.stat(follow_symlinks=False).st_mtime, grace, now, before):
                            found.append((folder, e.name))
        except OSError:
            continue
    return found


def untouched(mtime: float, grace: float, now: float, before: float) -> bool:
    return now - mtime >= grace and mtime < before


def remove_unnamed(found: Iterable[tuple[str, str]], grace: float, removed: list[tuple[str, int]],
                   before: float = math.inf) -> None:
    """Delete each file of `found` still untouched for `grace` seconds and since `before` (looked at again: a save
    may have begun since the scan); what went is added to `removed` as (path, bytes)."""
    for folder, name in found:
        path = os.path.join(folder, name)
        try:
            st = os.stat(path, follow_symlinks=False)
            if not untouched(st.st_mtime, grace, time.time(), before):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append((path, st.st_size))
        log.info("kv_file_removed key=%s folder=%s bytes=%d reason=orphan: no meta file of any replica names it, "
                 "and nothing wrote it for %g s", name, folder, st.st_size, grace)


class OrphanSweeper:
    """Runs `sweep` (the index's `sweep_orphans`) every `grace / 4` seconds (SWEEP_MIN_SECONDS at least), on the
    files written before `horizon(grace)` (with Redis: `Fleet.sweep_horizon`; None: not now)."""

    def __init__(self, sweep: Callable[[float, float], Awaitable[object]], grace: float,
                 horizon: Callable[[float], Awaitable[float | None]] | None = None) -> None:
        self.sweep = sweep
        self.grace = grace
        self.horizon = horizon
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.grace > 0:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def once(self) -> bool:
        """One sweep, when the horizon allows; whether it ran."""
        before = math.inf if self.horizon is None else await self.horizon(self.grace)
        if before is None:
            return False
        await self.sweep(self.grace, before)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(self.grace / 4, SWEEP_MIN_SECONDS))   # a period, not synchronisation
            try:
                await self.once()
            except asyncio.CancelledError:
                raise
            except Exception:   # a sweep that failed is tried at the next period
                log.exception("orphan_sweep_failed: tried again later")
