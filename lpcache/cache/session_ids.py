"""Which X-Session-ID values are a session, and the 32-hex id lpcache uses for each.

A session id is client input that ends up in a file name, so it never goes there raw. Exactly 32 lower-case hex
digits (what Marginalia sends, `uuid4().hex`) are used as they are: the file names of existing sessions do not
change. Any other text a client may send as an id (a UUID with dashes, `user-42`, a name in any script) is hashed
to that form: the first 32 hex digits of the SHA-256 of the value's bytes as sent (UTF-8), so the same value always
gives the same session, and `printf %s "$value" | sha256sum | cut -c1-32` tells a client which one. A value that
cannot be a session (empty, longer than `MAX_CHARS` characters, a control character, bytes that are not UTF-8) is
rejected: the request is served in prefix mode, as if it had no header, and `SessionIds` logs one warning per
distinct rejected value and counts every one.

HTTP headers reach lpcache as bytes that Starlette decodes as latin-1; `header_bytes` turns such a string back
into the bytes the client sent, so a UTF-8 name hashes the same through lpcache, through LiteLLM's hook, and in
`GET /lpcache/sessions/{id}/compare` (whose path is UTF-8).
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections import Counter, OrderedDict
from dataclasses import dataclass

MAX_CHARS = 256          # characters of an id (decoded from UTF-8)
WARNED_MAX = 1024        # distinct rejected values remembered, so each is logged once (the oldest forgotten first)
REASONS = ("empty", "too_long", "control_character", "not_utf8")

_HEX32 = re.compile(r"[0-9a-f]{32}")


def is_session_id(value: str) -> bool:
    """Whether `value` is already in lpcache's form (32 lower-case hex digits): the part of a file name it uses."""
    return _HEX32.fullmatch(value) is not None


def header_bytes(value: str) -> bytes:
    """The bytes of a header value as the client sent them: ASGI servers hand Starlette bytes it decodes as
    latin-1. A string with a character above U+00FF did not come that way; it is taken as text (UTF-8)."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class Reading:
    """What a value is: `id` the session lpcache uses (None: rejected, for `reason`); `hashed` when `id` is a
    digest of the value rather than the value itself."""

    id: str | None
    hashed: bool = False
    reason: str | None = None
    chars: int = 0


def read_session_id(raw: bytes) -> Reading:
    """The session a value names, by the rules above."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Reading(None, reason="not_utf8", chars=len(raw))
    if is_session_id(text):
        return Reading(text, chars=len(text))
    if not text.strip():
        return Reading(None, reason="empty", chars=len(text))
    if len(text) > MAX_CHARS:
        return Reading(None, reason="too_long", chars=len(text))
    if any(unicodedata.category(c) == "Cc" for c in text):
        return Reading(None, reason="control_character", chars=len(text))
    return Reading(hashlib.sha256(raw).hexdigest()[:32], hashed=True, chars=len(text))


def session_id(header: str | None) -> str | None:
    """The session lpcache uses for an X-Session-ID header value (as Starlette gives it), else None."""
    return None if header is None else read_session_id(header_bytes(header)).id


class SessionIds:
    """Reads the X-Session-ID of each request, counts what it found (`hashed`, `rejected` by reason, for
    /metrics), and warns once per distinct rejected value: never the value itself (it may hold anything, even a
    key sent by mistake), only its reason, length and the start of its SHA-256 (`digest`), which a client can
    compute to recognise it. At most WARNED_MAX values are remembered, so memory is bounded whatever clients send;
    a value forgotten is warned about again."""

    def __init__(self, log: logging.Logger, prefix: str = "", warned_max: int = WARNED_MAX) -> None:
        self.log = log
        self.prefix = prefix         # "slot_cache: " in the LiteLLM hook, as its other lines
        self.warned_max = warned_max
        self.hashed = 0
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.sources: Counter[str] = Counter()   # sessions served, by the header they came from (`agent_ids`)
        self._warned: OrderedDict[bytes, None] = OrderedDict()

    def read(self, header: str | None) -> str | None:
        """The session of a request whose X-Session-ID is `header` (None: no header, or rejected)."""
        if header is None:
            return None
        raw = header_bytes(header)
        reading = read_session_id(raw)
        if reading.id is not None:
            self.hashed += reading.hashed
            return reading.id
        assert reading.reason is not None
        self.rejected[reading.reason] += 1
        digest = hashlib.sha256(raw).digest()
        if digest in self._warned:
            self._warned.move_to_end(digest)
        else:
            self._warned[digest] = None
            while len(self._warned) > self.warned_max:
                self._warned.popitem(last=False)
            self.log.warning(self.prefix + "session_id_rejected reason=%s chars=%d sha256=%s: X-Session-ID cannot "
                             "be a session (empty, over %d characters, a control character, or not UTF-8); the "
                             "request is served in prefix mode (logged once per value)", reading.reason,
                             reading.chars, digest.hex()[:12], MAX_CHARS)
        return None
