"""Which session a request belongs to, as the client names it: `X-Session-ID`, or a coding agent's own header.

Coding agents send their own session ids on every request, without being asked, and name a sub-agent's parent:

- any client (OpenCode sends it on its own): `X-Session-ID`; a sub-agent's parent: `X-Parent-Session-ID` (OpenCode);
- Claude Code (2.1.86 on): `X-Claude-Code-Session-Id`; a sub-agent's turns add `X-Claude-Code-Agent-Id`, its
  parent: `X-Claude-Code-Parent-Agent-Id` (a nested one's), else the root session;
- Codex: `session-id` (older releases: `session_id`); a spawned thread adds `thread-id`, its parent:
  `x-codex-parent-thread-id`, else the root session;
- Claude Code on `/v1/messages` without its header (older releases): the session part of `metadata.user_id`.

The first of these that names a session wins, in this order: a client that sends `X-Session-ID` chose lpcache's session
mode itself, so its value wins over any agent header it also sends. A sub-agent's session is its own (the root's id
and its agent or thread id together: an agent id names an agent only within its root session), so its turns never
overwrite its parent's file; its parent is used only to seed its first turn (`slot_fill`). The value read is the
client's text; `session_ids` turns it into lpcache's 32-hex form or rejects it, as for `X-Session-ID`.

`source` names where the session came from (the request log's `lpcache-session-source`, the metrics); AGENT_SESSION_IDS
false reads `X-Session-ID` (and `X-Parent-Session-ID`) only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

SOURCES = ("x-session-id", "x-claude-code-session-id", "session-id", "metadata.user_id")

_LEGACY_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{1,128})$")   # user_<hash>_account_<uuid>_session_<uuid>


@dataclass(frozen=True)
class Named:
    """A session as the client named it (its text, before `session_ids`), the parents to seed it from, in the order
    they are tried, and the header it came from (one of SOURCES)."""

    session: str
    parents: tuple[str, ...] = ()
    source: str = "x-session-id"


def from_headers(headers: Mapping[str, str], agents: bool = True) -> Named | None:
    """The session the request's headers name (None: prefix mode). `headers` as Starlette gives them (lower-case
    names); `agents` False reads X-Session-ID only."""
    own = headers.get("x-session-id")
    if own is not None:
        parent = headers.get("x-parent-session-id")
        return Named(own, (parent,) if parent else ())
    if not agents:
        return None
    root = headers.get("x-claude-code-session-id")
    if root:
        agent = headers.get("x-claude-code-agent-id")
        if not agent:
            return Named(root, (), "x-claude-code-session-id")
        parent_agent = headers.get("x-claude-code-parent-agent-id")
        parents = (f"{root}/{parent_agent}", root) if parent_agent else (root,)
        return Named(f"{root}/{agent}", parents, "x-claude-code-session-id")
    codex = headers.get("session-id") or headers.get("session_id")
    if codex:
        thread, parent_thread = headers.get("thread-id"), headers.get("x-codex-parent-thread-id")
        if not (thread and parent_thread):
            return Named(codex, (), "session-id")
        return Named(f"{codex}/{thread}", (f"{codex}/{parent_thread}", codex), "session-id")
    return None


def from_metadata(body: Mapping[str, Any]) -> Named | None:
    """Claude Code's session on a Messages request without a session header: `metadata.user_id` is either
    `user_<hash>_account_<uuid>_session_<uuid>` (older releases) or a JSON object as text with a `session_id`."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str) or len(user_id) > 4096:
        return None
    session: Any = None
    if user_id.startswith("{"):
        try:   # orjson: a nesting too deep is a decode error, not a RecursionError
            session = orjson.loads(user_id).get("session_id")
        except (orjson.JSONDecodeError, AttributeError):
            return None
    else:
        found = _LEGACY_USER_ID.search(user_id)
        session = found.group(1) if found else None
    return Named(session, (), "metadata.user_id") if isinstance(session, str) and session else None
