"""Which session a request names: X-Session-ID, else a coding agent's own headers, in the documented order."""

from __future__ import annotations

import json

import pytest
from starlette.datastructures import Headers

from lpcache.cache.agent_ids import SOURCES, Named, from_headers, from_metadata
from lpcache.flow.guard import Caller


def headers(**values: str) -> Headers:
    """Headers as an ASGI server hands them to Starlette (names lower-cased), whatever case a client sent."""
    return Headers(raw=[(k.lower().encode(), v.encode()) for k, v in values.items()])


def test_x_session_id_wins_over_every_agent_header() -> None:
    h = headers(**{"X-Session-ID": "ses_abc", "X-Claude-Code-Session-Id": "cc-1", "session-id": "codex-1"})
    assert from_headers(h) == Named("ses_abc", (), "x-session-id")


def test_opencode_sub_agent_names_its_parent() -> None:
    h = headers(**{"x-session-id": "ses_child", "x-parent-session-id": "ses_parent", "x-session-affinity": "x"})
    assert from_headers(h) == Named("ses_child", ("ses_parent",), "x-session-id")


def test_claude_code_root_and_sub_agents() -> None:
    root = "2c4e1cf0-7a67-4d2e-9a4b-1d16d3f44752"
    assert from_headers(headers(**{"X-Claude-Code-Session-Id": root})) == Named(root, (), "x-claude-code-session-id")
    child = from_headers(headers(**{"X-Claude-Code-Session-Id": root, "X-Claude-Code-Agent-Id": "a7"}))
    assert child == Named(f"{root}/a7", (root,), "x-claude-code-session-id")
    nested = from_headers(headers(**{"X-Claude-Code-Session-Id": root, "X-Claude-Code-Agent-Id": "a9",
                                     "X-Claude-Code-Parent-Agent-Id": "a7"}))
    assert nested == Named(f"{root}/a9", (f"{root}/a7", root), "x-claude-code-session-id")
    # the same agent id under two root sessions is two sessions
    other = from_headers(headers(**{"X-Claude-Code-Session-Id": "other-root", "X-Claude-Code-Agent-Id": "a7"}))
    assert other is not None and child is not None and other.session != child.session


def test_claude_code_wins_over_codex() -> None:
    named = from_headers(headers(**{"X-Claude-Code-Session-Id": "cc", "session-id": "codex"}))
    assert named is not None and named.session == "cc"


def test_codex_session_and_spawned_threads() -> None:
    assert from_headers(headers(**{"session-id": "019a9544-7ab1"})) == Named("019a9544-7ab1", (), "session-id")
    assert from_headers(headers(session_id="old-codex")) == Named("old-codex", (), "session-id")
    # a root thread's own thread-id changes nothing: no parent thread
    assert from_headers(headers(**{"session-id": "s", "thread-id": "t0"})) == Named("s", (), "session-id")
    spawned = from_headers(headers(**{"session-id": "s", "thread-id": "t2", "x-codex-parent-thread-id": "t1"}))
    assert spawned == Named("s/t2", ("s/t1", "s"), "session-id")


def test_the_switch_reads_x_session_id_only() -> None:
    assert from_headers(headers(**{"X-Claude-Code-Session-Id": "cc", "session-id": "codex"}), agents=False) is None
    assert from_headers(headers(**{"X-Session-ID": "mine"}), agents=False) == Named("mine")
    assert from_headers(headers(**{"Content-Type": "application/json"})) is None


@pytest.mark.parametrize("user_id, session", [
    ("user_5dd07c33da27e6d2968d94ea20bf47a7b090b6b158b82328d54da2909a108e84_account__session_"
     "d2e70091-3007-41a3-a916-cb8b0d3098de", "d2e70091-3007-41a3-a916-cb8b0d3098de"),
    ("user_abc_account_8b1e2f00-1111-4222-8333-944445555666_session_0a1b-2c3d", "0a1b-2c3d"),
    (json.dumps({"device_id": "3f4a1b7c", "account_uuid": "", "session_id": "2c4e1cf0-7a67"}), "2c4e1cf0-7a67"),
])
def test_claude_code_metadata_user_id(user_id: str, session: str) -> None:
    assert from_metadata({"metadata": {"user_id": user_id}}) == Named(session, (), "metadata.user_id")


@pytest.mark.parametrize("body", [
    {}, {"metadata": None}, {"metadata": "user_x_session_y"}, {"metadata": {"user_id": 42}},
    {"metadata": {"user_id": "same-user-across-chats"}}, {"metadata": {"user_id": "{not json"}},
    {"metadata": {"user_id": "[1, 2]"}}, {"metadata": {"user_id": json.dumps({"session_id": 7})}},
    {"metadata": {"user_id": json.dumps({"session_id": ""})}}, {"metadata": {"user_id": "x" * 5000 + "_session_a"}},
    {"metadata": {"user_id": '{"a":' + "[" * 4000}},   # nested past any parser's depth: no RecursionError
])
def test_metadata_without_a_session(body: dict) -> None:
    assert from_metadata(body) is None


def test_caller_reads_the_body_only_without_a_session_header_on_messages() -> None:
    meta = {"metadata": {"user_id": json.dumps({"session_id": "from-body"})}}
    bare = Caller.of(headers(), keys_held=False)
    assert bare.named("messages", meta, True) == ("from-body", (), "metadata.user_id")
    assert bare.named("chat", meta, True) == (None, (), "x-session-id")        # a Messages field only
    assert bare.named("messages", meta, False) == (None, (), "x-session-id")   # the switch
    claude = Caller.of(headers(**{"X-Claude-Code-Session-Id": "hdr"}), keys_held=False)
    assert claude.named("messages", meta, True) == ("hdr", (), "x-claude-code-session-id")
    assert Caller.of(headers(**{"X-Claude-Code-Session-Id": "hdr"}), keys_held=False, agents=False).session is None
    assert set(SOURCES) == {"x-session-id", "x-claude-code-session-id", "session-id", "metadata.user_id"}
