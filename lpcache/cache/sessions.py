"""Session mode's pure parts: the file name of a session's cache, and where a session's prompt first differs from
its previous one.

A session id here is always lpcache's form, 32 lower-case hex digits (`session_ids` turns what a client sends into
it, or rejects it), so nothing a client sends reaches a path. Files are named per route (the model) and session,
with a readable, file-safe route tag and a short hash of the route name, so two models never share a file and the
name passes llama-server's filename check.

With client keys, a session belongs to the key that made it: its owner (a digest of the key, `guard.client_identity`)
is part of its file name and of its entry in the book, so another key that sends the same id gets a session of its
own (it can neither restore nor overwrite the first one's cache), and sees only its own sessions listed.

The book of sessions is bounded whatever clients send: at most `limit` sessions, and of each one's last prompt only
a `Summary` (digests and lengths; the text itself only for a short prompt), at most `budget` bytes in all.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lpcache.cache.prefix import content_text
from lpcache.cache.session_ids import is_session_id

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
ROUTE_TAG_CHARS = 40
TEXT_KEPT_CHARS = 8192          # a prompt this short is kept as text: its comparison is exact to the character
CHUNKS_MAX = 1024               # a longer one as digests of chunks (about this many): exact to a chunk ...
CHUNK_MIN_CHARS = 64            # ... of at least this many characters
BOOK_BUDGET_BYTES = 64 * 1024 * 1024   # all summaries of a book together


def route_name(model: str) -> str:
    """The route a request belongs to: its model, without LiteLLM's `openai/` prefix."""
    return model.removeprefix("openai/")


def route_tag(route: str, fingerprint: str | None = None) -> str:
    """Readable and file-safe, told apart by a hash of the exact name and of the model's identity (when known,
    `backends.backend.model_fingerprint`): `Qwen3_8B-1a2b3c4d`. A model swapped behind the same name gets another
    tag, so its sessions never restore the old model's files."""
    ident = route if fingerprint is None else f"{route}\n{fingerprint}"
    return _UNSAFE.sub("_", route)[:ROUTE_TAG_CHARS] + "-" + hashlib.sha256(ident.encode()).hexdigest()[:8]


def session_filename(route: str, session: str, fingerprint: str | None = None, owner: str | None = None) -> str:
    """`<route tag>_<session>.bin`; with an `owner`, the session part is a digest of owner and session (32 hex
    digits as well, so the name has the same form). Raises ValueError for a session id that is not 32 lower-case
    hex digits."""
    if not is_session_id(session):
        raise ValueError("not a session id")
    if owner is not None:
        session = hashlib.sha256(f"{owner}\n{session}".encode()).hexdigest()[:32]
    return f"{route_tag(route, fingerprint)}_{session}.bin"


@dataclass(frozen=True)
class Comparison:
    """Where a prompt first differs from the session's previous one. A server can reuse its cache up to there and
    not after it, however much of the rest is the same (a message is three or four characters per token)."""

    same: bool                   # identical messages
    message: int | None          # index of the first message that differs (None when identical)
    role: str | None             # its role in the new prompt (None when the new prompt has fewer messages)
    shared_chars: int            # characters of message content shared from the start
    total_chars: int             # characters of message content in the new prompt
    last_shared_chars: int       # characters the two prompts' last messages share from their start
    reading: str                 # a short reading of the difference
    messages: int = 0            # messages in the new prompt ...
    previous_messages: int = 0   # ... and in the previous one
    message_shared_chars: int = 0  # characters the differing message shares with the previous one's
    message_chars: int = 0         # its length now ...
    previous_message_chars: int = 0  # ... and before
    last_chars: int = 0            # the new prompt's last message length
    previous_last_chars: int = 0   # the previous prompt's last message length

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def log_line(self) -> str:
        head = f"{self.messages} messages, the previous prompt had {self.previous_messages}: "
        if self.same:
            return head + "the same as the previous one"
        if self.role is None or self.message is None or self.message >= self.previous_messages:
            said = (f"the first {self.message} are the same, "
                    + ("new messages follow" if self.role is not None else "the end is cut"))
        else:
            said = (f"the first {self.message} are the same, message {self.message} (role {self.role}) is the same "
                    f"for its first {self.message_shared_chars} of {self.message_chars} characters (the previous "
                    f"one: {self.previous_message_chars})")
        return (head + said + f"; {self.shared_chars} of {self.total_chars} characters shared; the last message is "
                f"the same as the previous prompt's last for its first {self.last_shared_chars} of {self.last_chars} "
                f"characters (the previous one: {self.previous_last_chars}): {self.reading}")


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _pairs(messages: Sequence[Any]) -> list[tuple[str | None, str]]:
    return [(m.get("role") if isinstance(m.get("role"), str) else None, content_text(m.get("content")))
            for m in messages if isinstance(m, dict)]


@dataclass(eq=False)
class Summary:
    """What a comparison needs of a prompt, in bounded memory: per message the digests of its role and text, its
    length and the digests of its text in chunks of `chunk` characters; the texts themselves only when the whole
    prompt is under TEXT_KEPT_CHARS. Where a message differs is then exact to the character for a short prompt and
    to a chunk (a lower bound) for a long one."""

    roles: array
    texts: array
    lengths: array
    chunk: int
    chunks: array
    starts: array                                     # message i's chunks: chunks[starts[i]:starts[i + 1]]
    kept: tuple[tuple[str | None, str], ...] | None   # the messages themselves, for a short prompt

    @classmethod
    def of(cls, messages: Sequence[Any]) -> Summary:
        pairs = _pairs(messages)
        chars = sum(len(text) + len(role or "") for role, text in pairs)
        chunk = max(CHUNK_MIN_CHARS, math.ceil(chars / CHUNKS_MAX))
        roles, texts, lengths, chunks, starts = array("Q"), array("Q"), array("Q"), array("Q"), array("Q", [0])
        for role, text in pairs:
            roles.append(_digest(role or ""))
            texts.append(_digest(text))
            lengths.append(len(text))
            if chars > TEXT_KEPT_CHARS:
                chunks.extend(_digest(text[i:i + chunk]) for i in range(0, len(text), chunk))
            starts.append(len(chunks))
        return cls(roles, texts, lengths, chunk, chunks, starts, tuple(pairs) if chars <= TEXT_KEPT_CHARS else None)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        kept = sum(4 * (len(t) + len(r or "")) + 120 for r, t in self.kept) if self.kept is not None else 0
        return kept + 8 * (4 * len(self.lengths) + len(self.chunks)) + 400

    def same(self, i: int, role: str | None, text: str) -> bool:
        if self.kept is not None:
            return self.kept[i] == (role, text)
        return (self.lengths[i] == len(text) and self.roles[i] == _digest(role or "")
                and self.texts[i] == _digest(text))

    def same_role(self, i: int, role: str | None) -> bool:
        return self.kept[i][0] == role if self.kept is not None else self.roles[i] == _digest(role or "")

    def common(self, i: int, text: str) -> int:
        """Characters message i's text shares with `text` from the start (for a long prompt: whole chunks)."""
        if self.kept is not None:
            return _common(self.kept[i][1], text)
        length = self.lengths[i]
        if length <= len(text) and self.texts[i] == _digest(text[:length]):
            return length
        shared = 0
        for k in range(self.starts[i], self.starts[i + 1]):
            end = min(shared + self.chunk, length)
            if self.chunks[k] != _digest(text[shared:end]) or len(text) < end:
                break
            shared = end
        return shared


def compare(previous: Sequence[Any] | Summary, current: Sequence[Any]) -> Comparison:
    """Compare two chat prompts message by message (role and text). Messages count from 0. `previous` may be the
    `Summary` of the earlier prompt (what the book keeps)."""
    old = previous if isinstance(previous, Summary) else Summary.of(previous)
    new = _pairs(current)
    total = sum(len(text) for _, text in new)
    last = old.common(len(old) - 1, new[-1][1]) if len(old) and new else 0
    sizes = {"messages": len(new), "previous_messages": len(old),
             "last_chars": len(new[-1][1]) if new else 0, "previous_last_chars": old.lengths[-1] if len(old) else 0}
    shared = 0
    for i, (role, text) in enumerate(new):
        if i >= len(old):
            return Comparison(False, i, role, shared, total, last,
                              "only messages were added: the whole previous prompt can be reused",
                              message_chars=len(text), **sizes)
        if not old.same(i, role, text):
            same_here = old.common(i, text) if old.same_role(i, role) else 0
            shared += same_here
            if i == 0:
                reading = "the first (system) message differs: the whole prompt is read again"
            elif i == len(old) - 1:
                reading = "only the previous prompt's last message differs: the most a next turn can reuse"
            else:
                reading = "a message in the middle differs: everything after it is read again"
            return Comparison(False, i, role, shared, total, last, reading, message_shared_chars=same_here,
                              message_chars=len(text), previous_message_chars=old.lengths[i], **sizes)
        shared += len(text)
    if len(old) > len(new):
        return Comparison(False, len(new), None, shared, total, last, "messages were removed at the end", **sizes)
    return Comparison(True, None, None, shared, total, last, "identical", **sizes)


@dataclass
class SessionInfo:
    """What lpcache knows of one session on one route, for the log line, /lpcache/sessions and the swap."""

    session: str
    route: str
    file: str
    last_use: float = 0.0            # wall clock of its last request
    requests: int = 0
    cache_hits: int = 0              # requests served with its cache (resident in the slot, or restored)
    restores: int = 0
    saves: int = 0
    file_bytes: int | None = None    # size of its file after the last save, as the server reported it
    saved_chain: tuple[int, ...] = ()  # block chain of the prompt its file holds
    saved_tokens: int | None = None  # tokens its file holds (None: not known here)
    saved_at: float = 0.0            # wall clock of the save that wrote its newest file, as far as this replica knows
    saved_here: bool = False         # that save was this replica's (with REDIS_URL: its document is its to write)
    homes: set[int] = field(default_factory=set)  # backends (indexes) that saved a copy of its file, older ones too
    latest: int | None = None        # the backend that saved the newest copy (None: not known, e.g. an old document)
    summary: Summary | None = None   # its last prompt, to say where the next one differs
    comparison: Comparison | None = None
    owner: str | None = None         # digest of the client key that made it (None without client keys)
    parents: tuple[str, ...] = ()    # a sub-agent's parent sessions' files, as its client named them (seeding)
    apis: dict[str, int] = field(default_factory=dict)  # its requests by API (chat, responses, messages...)

    def saved(self, backend: int, file_bytes: int | None, chain: tuple[int, ...],
              tokens: int | None = None) -> None:
        """Its file was just written by `backend` and holds the prompt of `chain` (`tokens` of it, when known). With
        a slot-save folder per server, the copies other servers saved before are now older: `latest` says where the
        newest is (`SlotFill.session_homes`)."""
        self.saves += 1
        self.file_bytes, self.saved_chain, self.saved_tokens = file_bytes, chain, tokens
        self.saved_at = max(time.time(), self.saved_at + 0.001)   # after the save it knew, whatever the clock says
        self.latest, self.saved_here = backend, True
        self.homes.add(backend)

    def as_dict(self) -> dict[str, Any]:
        return {"session": self.session, "route": self.route, "file": self.file, "last_use": self.last_use,
                "requests": self.requests, "cache_hits": self.cache_hits, "restores": self.restores,
                "saves": self.saves, "file_bytes": self.file_bytes, "apis": dict(self.apis)}


class SessionBook:
    """The sessions seen since start, the most recently used last; at most `limit`, and their prompt summaries at
    most `budget` bytes together (the oldest are forgotten: their files stay, only the comparison with their
    previous prompt is lost; a prompt whose summary alone exceeds the budget is not compared)."""

    def __init__(self, limit: int = 1024, budget: int = BOOK_BUDGET_BYTES) -> None:
        self.limit = limit
        self.budget = budget
        self.bytes = 0
        self._by_file: dict[str, SessionInfo] = {}
        self.on_saved: Callable[[SessionInfo], None] | None = None   # set with REDIS_URL (`fleet`)

    def __len__(self) -> int:
        return len(self._by_file)

    def read(self, file: str, messages: Sequence[Any]) -> tuple[Summary, Comparison | None]:
        """The work `seen` does in proportion to the prompt: its summary, and its comparison with the session's
        previous one. Changes nothing, so a big prompt's may run in a worker thread (`apis.base.off_loop`)."""
        info = self._by_file.get(file)
        previous = info.summary if info is not None else None
        return Summary.of(messages), None if previous is None else compare(previous, messages)

    def seen(self, file: str, session: str, route: str, messages: Sequence[Any], now: float,
             owner: str | None = None, read: tuple[Summary, Comparison | None] | None = None,
             api: str = "chat") -> SessionInfo:
        """A request of the session arrived: count it, and compare its prompt with the previous one (`read`: that
        work done already). `owner`: the client key's digest (it names the file too, so one file never has two
        owners)."""
        summary, comparison = self.read(file, messages) if read is None else read
        info = self._by_file.pop(file, None) or SessionInfo(session, route, file, owner=owner)
        self._by_file[file] = info
        if info.summary is not None:
            info.comparison = comparison
            self.bytes -= info.summary.nbytes
        info.requests += 1
        info.apis[api] = info.apis.get(api, 0) + 1
        info.last_use = now
        info.summary = summary
        self.bytes += info.summary.nbytes
        while len(self._by_file) > self.limit or (self.bytes > self.budget and len(self._by_file) > 1):
            self._forget(next(iter(self._by_file)))
        if self.bytes > self.budget:
            self.bytes -= info.summary.nbytes
            info.summary = None
        return info

    def _forget(self, file: str) -> None:
        info = self._by_file.pop(file)
        if info.summary is not None:
            self.bytes -= info.summary.nbytes

    def get(self, file: str) -> SessionInfo | None:
        return self._by_file.get(file)

    def saved(self, info: SessionInfo, backend: int, file_bytes: int | None, chain: tuple[int, ...],
              tokens: int | None = None) -> None:
        """The session's file was just written (`SessionInfo.saved`); with REDIS_URL the other replicas are told."""
        info.saved(backend, file_bytes, chain, tokens)
        if self.on_saved is not None:
            self.on_saved(info)

    def known(self, file: str, session: str, route: str, owner: str | None) -> SessionInfo:
        """The entry of a session another replica served (created, oldest first, when this one never saw it)."""
        info = self._by_file.get(file)
        if info is None:
            info = self._by_file[file] = SessionInfo(session, route, file, owner=owner)
            while len(self._by_file) > self.limit:
                self._forget(next(iter(self._by_file)))
        return info

    def all_owners(self) -> list[SessionInfo]:
        return list(self._by_file.values())

    def of_session(self, session: str, route: str | None = None, owner: str | None = None) -> SessionInfo | None:
        """The session's most recently used entry (on `route`, when given) of `owner`'s sessions."""
        for info in reversed(self._by_file.values()):
            if info.session == session and info.owner == owner and (route is None or info.route == route):
                return info
        return None

    def all(self, owner: str | None = None) -> list[SessionInfo]:
        """`owner`'s sessions (without client keys every session has owner None), most recently used first."""
        return [info for info in reversed(self._by_file.values()) if info.owner == owner]
