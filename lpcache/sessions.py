"""Session mode's pure parts: which X-Session-ID values count, the file name of a session's cache, and where a
session's prompt first differs from its previous one.

A session id is client input that becomes part of a file name, so only 32 lower-case hex digits are accepted;
anything else is ignored (the request falls back to prefix mode) and never reaches a path. Files are named per
route (the model) and session, with a readable, file-safe route tag and a short hash of the route name, so two
models never share a file and the name passes llama-server's filename check.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .prefix import content_text

_SESSION_ID = re.compile(r"[0-9a-f]{32}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
ROUTE_TAG_CHARS = 40


def session_id(header: str | None) -> str | None:
    """The X-Session-ID value when it is exactly 32 lower-case hex digits, else None."""
    if header is not None and _SESSION_ID.fullmatch(header):
        return header
    return None


def route_name(model: str) -> str:
    """The route a request belongs to: its model, without LiteLLM's `openai/` prefix."""
    return model.removeprefix("openai/")


def route_tag(route: str) -> str:
    """Readable and file-safe, told apart by a hash of the exact name: `Qwen3_8B-1a2b3c4d`."""
    return _UNSAFE.sub("_", route)[:ROUTE_TAG_CHARS] + "-" + hashlib.sha256(route.encode()).hexdigest()[:8]


def session_filename(route: str, session: str) -> str:
    """`<route tag>_<session>.bin`. Raises ValueError for a session id that is not 32 lower-case hex digits."""
    if session_id(session) is None:
        raise ValueError("not a session id")
    return f"{route_tag(route)}_{session}.bin"


@dataclass(frozen=True)
class Comparison:
    """Where a prompt first differs from the session's previous one."""

    same: bool                   # identical messages
    message: int | None          # index of the first message that differs (None when identical)
    role: str | None             # its role in the new prompt (None when the new prompt has fewer messages)
    shared_chars: int            # characters of message content shared from the start
    total_chars: int             # characters of message content in the new prompt
    last_shared_chars: int       # characters the two prompts' last messages share from their start
    reading: str                 # a short reading of the difference

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def log_line(self) -> str:
        if self.same:
            return "prompt identical to the previous one"
        return (f"prompt differs from the previous one at message {self.message} (role {self.role}), "
                f"{self.shared_chars} of {self.total_chars} characters shared; last messages agree for "
                f"{self.last_shared_chars} characters: {self.reading}")


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def compare(previous: Sequence[Any], current: Sequence[Any]) -> Comparison:
    """Compare two chat prompts message by message (role and text)."""
    old = [(m.get("role"), content_text(m.get("content"))) for m in previous if isinstance(m, dict)]
    new = [(m.get("role"), content_text(m.get("content"))) for m in current if isinstance(m, dict)]
    total = sum(len(text) for _, text in new)
    last = _common(old[-1][1], new[-1][1]) if old and new else 0
    shared = 0
    for i, (role, text) in enumerate(new):
        if i >= len(old):
            return Comparison(False, i, role, shared, total, last,
                              "only messages were added: the whole previous prompt can be reused")
        old_role, old_text = old[i]
        if (role, text) != (old_role, old_text):
            shared += _common(old_text, text) if role == old_role else 0
            if i == 0:
                reading = "the first (system) message differs: the whole prompt is read again"
            elif i == len(old) - 1:
                reading = "only the previous prompt's last message differs: the most a next turn can reuse"
            else:
                reading = "a message in the middle differs: everything after it is read again"
            return Comparison(False, i, role, shared, total, last, reading)
        shared += len(text)
    if len(old) > len(new):
        return Comparison(False, len(new), None, shared, total, last,
                          "messages were removed at the end")
    return Comparison(True, None, None, shared, total, last, "identical")
