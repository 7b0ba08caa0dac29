"""Sessions that start anew, against the stand-in: an agent's next session or sub-agent starts from the harness an
earlier session computed (its parent's first), as the same requests without a header would; never from another
client key's session. Agents' own session headers name the session; the request log and /metrics say where from."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from lpcache.workloads.agents import Session, sessions

from .conftest import until

KEY_A, KEY_B = "key-alpha-7Q", "key-beta-9Z"


def agents(n: int) -> list[Session]:
    """n coding-agent sessions sharing one harness (system prompt with an environment block, eight tool schemas),
    each its own task: real shapes (tool calls and results, code, paths, mixed case), sent on /v1/messages."""
    return sessions(n, steps=2, seed=41, apis=("messages",))


def send(proxy: Any, session: Session, turn: int, headers: dict[str, str]) -> httpx.Response:
    r = proxy.client.post("/v1/messages", json=session.body(turn, max_tokens=4), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    proxy.settle()
    return r


def cache_n(proxy: Any) -> int:
    return int(proxy.records[-1].cached_tokens or 0)


@pytest.fixture
def one_slot(start_backend: Any) -> Any:
    return start_backend(slots=1)


def test_a_new_session_starts_from_another_sessions_harness(start_proxy: Any, one_slot: Any) -> None:
    proxy = start_proxy(one_slot)
    first, second = agents(2)
    send(proxy, first, 0, {"X-Session-ID": "ses_first"})
    harness = proxy.records[-1].prompt_tokens
    send(proxy, first, 1, {"X-Session-ID": "ses_first"})         # the first session's file moves on
    # the only slot now serves an unrelated chat in prefix mode: the harness is in the first session's file only
    proxy.push([{"role": "user", "content": "Écris un haïku sur la mer, s'il te plaît."}], max_tokens=4)
    send(proxy, second, 0, {"X-Session-ID": "ses_second"})
    record = proxy.records[-1]
    assert record.session_source == "x-session-id"
    assert record.seeded == "session" and record.restored is True
    assert record.restore_file == next(f for f in os.listdir(one_slot.app_state.config.slot_save_path)
                                       if f.endswith(".bin") and proxy.pipeline.sessions.get(f) is not None
                                       and proxy.pipeline.sessions.get(f).session != record.session)
    # the shared harness came from that file: only the new task is computed (a tenth of the prompt at most)
    assert record.prompt_tokens - cache_n(proxy) < 0.1 * record.prompt_tokens < 0.1 * 1.2 * harness


def test_a_sub_agent_starts_from_its_parents_file_first(start_proxy: Any, one_slot: Any) -> None:
    proxy = start_proxy(one_slot)
    parent, other, child = agents(3)
    send(proxy, parent, 0, {"x-session-id": "ses_parent"})
    send(proxy, other, 0, {"x-session-id": "ses_other"})          # newer, and shares as much of the harness
    proxy.push([{"role": "user", "content": "def f(x):\n    return x ** 2  # what does this do?"}], max_tokens=4)
    send(proxy, child, 0, {"x-session-id": "ses_child", "x-parent-session-id": "ses_parent"})
    record = proxy.records[-1]
    assert record.seeded == "parent"
    assert proxy.pipeline.sessions.get(record.restore_file).parents == ()
    assert proxy.pipeline.sessions.get(record.restore_file).session == proxy.records[0].session
    # without a parent named, the newest session that shares as much is the seed
    send(proxy, agents(4)[3], 0, {"x-session-id": "ses_orphan"})
    assert proxy.records[-1].seeded in ("session", "resident")


def test_claude_code_headers_name_sessions_and_sub_agents(start_proxy: Any, start_backend: Any) -> None:
    backend = start_backend(slots=2)
    proxy = start_proxy(backend, plugins=({"name": "request_log", "params": {
        "path": os.path.join(backend.app_state.config.slot_save_path, "..", "req.log"),
        "fields": "lpcache-session-source,lpcache-seeded,lpcache-route"}},))
    root, sub = agents(2)
    send(proxy, root, 0, {"X-Claude-Code-Session-Id": "2c4e1cf0-7a67-4d2e-9a4b-1d16d3f44752"})
    assert proxy.records[-1].session_source == "x-claude-code-session-id"
    send(proxy, sub, 0, {"X-Claude-Code-Session-Id": "2c4e1cf0-7a67-4d2e-9a4b-1d16d3f44752",
                         "X-Claude-Code-Agent-Id": "a3f9"})
    child = proxy.records[-1]
    assert child.session != proxy.records[0].session            # a session of its own
    assert child.seeded in ("parent", "resident")                # the harness from its root's cache
    assert cache_n(proxy) > 0.5 * child.prompt_tokens
    # Codex's header, and Claude Code's metadata.user_id without the header
    send(proxy, root, 0, {"session-id": "019a9544-7ab1-73c1-837e-1fa681f4462b"})
    assert proxy.records[-1].session_source == "session-id"
    body = {**root.body(0, max_tokens=4), "metadata": {"user_id": "user_ab12_account__session_d2e70091-3007"}}
    assert proxy.client.post("/v1/messages", json=body, timeout=60).status_code == 200
    proxy.settle()
    assert proxy.records[-1].session_source == "metadata.user_id" and proxy.records[-1].session is not None
    metrics = proxy.client.get("/metrics").text
    for source, n in (("x-claude-code-session-id", 2), ("session-id", 1), ("metadata.user_id", 1),
                      ("x-session-id", 0)):
        assert f'lpcache_session_requests_total{{source="{source}"}} {n}.0' in metrics
    assert 'lpcache_session_seeds_total{source="none"} 1.0' in metrics   # the very first, from nothing
    log = open(os.path.join(backend.app_state.config.slot_save_path, "..", "req.log")).read().splitlines()
    rows = [line.split() for line in log if not line.startswith("#")]
    assert [r[0] for r in rows] == ["x-claude-code-session-id", "x-claude-code-session-id", "session-id",
                                    "metadata.user_id"]
    assert rows[1][1] in ("parent", "resident") and rows[1][2].endswith("_seeded")


def test_the_switch_leaves_agent_headers_to_prefix_mode(start_proxy: Any, one_slot: Any) -> None:
    proxy = start_proxy(one_slot, agent_session_ids=False)
    root, = agents(1)
    send(proxy, root, 0, {"X-Claude-Code-Session-Id": "cc-root", "session-id": "codex-root"})
    assert proxy.records[-1].session is None and proxy.records[-1].session_source is None
    send(proxy, root, 0, {"X-Session-ID": "still-read"})
    assert proxy.records[-1].session is not None


def test_a_session_never_starts_from_another_keys_session(start_proxy: Any, one_slot: Any) -> None:
    proxy = start_proxy(one_slot, api_keys=(KEY_A, KEY_B))
    first, second, third = agents(3)
    a = {"Authorization": f"Bearer {KEY_A}"}
    b = {"Authorization": f"Bearer {KEY_B}"}
    send(proxy, first, 0, {**a, "X-Session-ID": "shared-name"})
    proxy.push([{"role": "user", "content": "Quel temps fait-il à Zürich ?"}], {**a}, max_tokens=4)
    send(proxy, second, 0, {**b, "X-Session-ID": "b-own"})
    other_key = proxy.records[-1]
    assert other_key.seeded is None and other_key.restored is not True
    assert cache_n(proxy) < 0.2 * other_key.prompt_tokens      # computed: key A's file was never offered
    proxy.push([{"role": "user", "content": "Quel temps fait-il à Genève ?"}], {**a}, max_tokens=4)
    send(proxy, third, 0, {**a, "X-Session-ID": "a-next"})
    same_key = proxy.records[-1]
    assert same_key.seeded == "session" and cache_n(proxy) > 0.5 * same_key.prompt_tokens
    until(lambda: proxy.pipeline.filler.seeds.seeds["session"] == 1)


def test_a_slot_holding_another_keys_session_is_not_taken_for_its_prefix(start_proxy: Any,
                                                                        start_backend: Any) -> None:
    backend = start_backend(slots=2)
    proxy = start_proxy(backend, api_keys=(KEY_A, KEY_B))
    first, second, third = agents(3)
    send(proxy, first, 0, {"Authorization": f"Bearer {KEY_A}", "X-Session-ID": "a-1"})
    a_slot = proxy.records[-1].slot
    send(proxy, second, 0, {"Authorization": f"Bearer {KEY_B}", "X-Session-ID": "b-1"})
    other_key = proxy.records[-1]
    assert other_key.slot != a_slot and other_key.seeded is None
    assert cache_n(proxy) < 0.2 * other_key.prompt_tokens   # the harness computed: nothing of key A's was used
    # key A's next session does start from its own session's slot
    send(proxy, third, 0, {"Authorization": f"Bearer {KEY_A}", "X-Session-ID": "a-2"})
    assert proxy.records[-1].seeded == "resident" and proxy.records[-1].slot == a_slot
    assert cache_n(proxy) > 0.8 * proxy.records[-1].prompt_tokens
