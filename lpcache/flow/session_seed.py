"""Where a session that starts anew starts from: its first turn, a session whose file is gone, or one whose prompt
left what its file holds. Session mode alone started such a request from nothing (a sub-agent computed its whole
harness again, while the same requests without a header restored it), so it is placed as in prefix mode: a slot
that holds its prefix, a prefix-mode file, or the file of another session of the same client key, route and model
(its parent's first, when the client names one: `agent_ids`), whichever shares most of the prompt. Never a session
of another client key: the book lists only the owner's (`SessionBook.all`). What each started from is counted
(`seeds`, in /metrics) and recorded (`RequestRecord.seeded`, the request log's `lpcache-seeded`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

from lpcache.backends.backend import Backend
from lpcache.backends.placement import RESIDENT_MIN_SHARE, Choice
from lpcache.backends.slots import Content, Slot
from lpcache.backends.swap import Folders
from lpcache.cache.index import MetaIndex
from lpcache.cache.meta_files import Candidate, MetaEntry
from lpcache.cache.prefix import Prompt, common_prefix
from lpcache.cache.sessions import SessionBook, SessionInfo
from lpcache.flow.record import RequestRecord

SEED_SOURCES = ("resident", "file", "session", "parent", "none")   # what a session starting anew started from


class SessionSeeds:
    def __init__(self, sessions: SessionBook, backends: Sequence[Backend], folders: Sequence[Folders],
                 index: MetaIndex | None = None, words_per_block: int = 0, lcp_th: float = 0.0) -> None:
        self.sessions = sessions
        self.index = index
        self.backends = backends
        self.folders = folders
        self.words_per_block = words_per_block
        self.lcp_th = lcp_th
        self.seeds: Counter[str] = Counter()

    def starts_anew(self, want: Content, prompt: Prompt, slots: Sequence[Slot]) -> SessionInfo | None:
        """The session's entry when its own cache is no place to start from: no slot holds it (nor is about to), no
        folder has its file (its first turn, a file gone), or the prompt does not continue what its file holds
        (two conversations sending one session id, a client that rewrote its history): the request is placed as
        in prefix mode (`seed_lookup`), so a session is never worse off than the same requests without the header.
        None: its own cache is where it starts (a slot, its file, or a folder lpcache cannot see, where it may be;
        after a restart lpcache has not seen its file yet, so every folder is looked in)."""
        info = self.sessions.get(want.key)
        if info is None:
            return None
        if info.saved_chain and common_prefix(info.saved_chain, prompt.exact) < len(info.saved_chain) - 1:
            return info   # its last block may differ: the generation prompt, where the answer now follows
        for slot in slots:
            if any(c is not None and c.key == want.key for c in (slot.content, slot.pending)):
                return None
        for home in info.homes or range(len(self.folders)):
            if self.file_there(home, want.key) is not False:
                return None
        return info

    def owned_by(self, owner: str | None) -> Callable[[Slot], bool]:
        """The slots a session of `owner` may start on for what they hold: any but those holding (or about to hold)
        another client key's session."""
        def mine(slot: Slot) -> bool:
            held = (slot.pending or slot.content) if slot.busy else slot.content
            if held is None or held.session is None:
                return True
            info = self.sessions.get(held.key)
            return info is not None and info.owner == owner   # a session the book forgot may be anyone's

        return mine

    def protect(self, file: str) -> None:
        """A seed was chosen to restore: a prefix-mode file (the index's limits keep it) or a session's (the
        session limits keep it), until `unprotect`."""
        if self.index is not None:
            self.index.protect(file)
        for folders in self.folders:
            folders.protected[file] += 1

    def unprotect(self, file: str) -> None:
        if self.index is not None:
            self.index.unprotect(file)
        for folders in self.folders:
            folders.protected[file] -= 1
            if folders.protected[file] <= 0:
                del folders.protected[file]

    def used(self, backend: int, file: str) -> None:
        """A seed's restore worked: its file is the last of its route the limits delete (off the loop)."""
        folder = self.folders[backend].of(file) if backend < len(self.folders) else None
        if folder is not None:
            folder.touch(file)

    def file_there(self, backend: int, file: str) -> bool | None:
        """Whether a session's file is in that server's slot-save folder (None: not visible from here)."""
        folder = self.folders[backend].of(file) if backend < len(self.folders) else None
        return None if folder is None else folder.has(file)

    def found_homes(self, file: str) -> frozenset[int]:
        """The backends whose slot-save folder has the newest copy of a session's file (the last modified: a save
        rewrites it; the largest on a tie), for a session the book knows no home of: one another replica saved
        before this one heard of it (Redis slow or down), one the book forgot, or one saved before a restart with
        another META_DIR. Empty when no folder visible here has it, or when a server's folder is not visible
        (its copy may be the newest)."""
        copies: dict[int, tuple[float, int]] = {}
        stats: dict[str, tuple[float, int] | None] = {}   # one look per folder, however many servers share it
        for backend, folders in enumerate(self.folders):
            folder = folders.of(file)
            if folder is None or not folder.path:
                return frozenset()
            if folder.path not in stats:
                stats[folder.path] = folder.stat(file)
            found = stats[folder.path]
            if found is not None:
                copies[backend] = found
        newest = max(copies.values(), default=None)
        return frozenset(b for b, copy in copies.items() if copy == newest)

    def seed_lookup(self, prompt: Prompt, want: Content, info: SessionInfo,
                    files: Callable[[], Candidate | None]) -> Callable[[], Candidate | None]:
        """The best saved cache to start a session from: a prefix-mode file (`files`: `SlotFiller.lookup`), or the
        file of a session of the same client key, route and model that shares more of the prompt (`session_seed`)."""
        def find() -> Candidate | None:
            best = files()
            other = self.session_seed(prompt, want, info)
            if other is not None and (best is None or other.shared > best.shared):
                return other
            return best

        return find

    def session_seed(self, prompt: Prompt, want: Content, info: SessionInfo) -> Candidate | None:
        """A session's file to seed `want` from (`seed_lookup`), as a candidate whose entry names that file: the one
        of its client key, route and model that shares most of the prompt (its own, when the prompt left it for
        another branch; a parent before others on a tie; the newest then)."""
        if not prompt.exact or want.fingerprint is None:
            return None
        tag = want.key.rpartition("_")[0]
        parents = {name: len(info.parents) - i for i, name in enumerate(info.parents)}
        # as a prefix-mode file: a share of the prompt of at least LCP_TH (a system prompt alone is not a seed)
        least = max(1, math.ceil(max(self.lcp_th, RESIDENT_MIN_SHARE) * len(prompt.exact)))
        ranked: list[tuple[int, int, float, SessionInfo]] = []
        for other in self.sessions.all(info.owner):
            if not other.saved_chain or other.saved_chain[0] != prompt.exact[0] or not other.homes \
                    or other.file.rpartition("_")[0] != tag:
                continue
            shared = common_prefix(other.saved_chain, prompt.exact)
            if shared >= least:
                ranked.append((shared, parents.get(other.file, 0), other.saved_at, other))
        ranked.sort(key=lambda r: r[:3], reverse=True)
        for shared, _, _, other in ranked[:8]:
            home = other.latest if other.latest is not None else min(other.homes)
            if home >= len(self.backends) or self.file_there(home, other.file) is False:
                continue   # deleted by the session limits since
            backend = self.backends[home]
            entry = MetaEntry(other.file, prompt.model, self.words_per_block, (), other.saved_at,
                              backend=backend.url, slot_save_path=backend.config.slot_save_path,
                              exact=other.saved_chain, fingerprint=want.fingerprint, n_tokens=other.saved_tokens,
                              size=other.file_bytes or 0)
            return Candidate(entry, shared, shared / len(prompt.exact))
        return None

    def seeded_from(self, choice: Choice, info: SessionInfo) -> str | None:
        """What a session starting anew starts from (`record.seeded`, counted): a slot that holds its prefix
        (`resident`), a prefix-mode file (`file`), another session's file (`session`), its parent's (`parent`);
        None: nothing."""
        if choice.restore is None:
            found = "resident" if choice.resident else None
            self.seeds[found or "none"] += 1   # a restore's seed is counted once it worked (`restored`)
            return found
        other = self.sessions.get(choice.restore.entry.key)
        if other is None:
            return "file"
        return "parent" if other.file in info.parents else "session"

    def outcome(self, seeding: bool, record: RequestRecord, ok: bool) -> None:
        """A session starting anew (`seeding`) restored its seed (`ok`), or found it gone or failed: counted and
        recorded only as what it really started from."""
        if seeding and record.seeded is not None:
            record.seeded = self.restored(record.seeded, ok)
            if not ok and record.route is not None:
                record.route = record.route.removesuffix("_seeded")

    def restored(self, seeded: str, ok: bool) -> str | None:
        """The restore of a seed (`seeded_from`) is over: counted as that seed when it worked, else as none."""
        self.seeds[seeded if ok else "none"] += 1
        return seeded if ok else None
