"""Agents' sessions through lpcache in front of the real llama-server (b11434, SmolLM2, -np 2, no RAM cache, the
chatml-tools template so the harness's tool schemas are in the prompt): a sub-agent named by Claude Code's headers
starts from its parent's saved harness; a session of another client key never starts from that harness."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads.agents import Session, sessions
from lpcache.workloads.harness import REPO, LlamaServer

from ..conftest import Proxy

pytestmark = pytest.mark.e2e

TEMPLATE = REPO / "bench" / "templates" / "chatml-tools.jinja"
KEY_A, KEY_B = "e2e-key-alpha", "e2e-key-beta"
ROOT = "7f1c2e90-4b1d-4e8a-9c3a-5d2f0b6a1e77"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with LlamaServer(str(tmp_path_factory.mktemp("slots")), n_slots=2, ctx=16384 * 2, cache_ram=0,
                     extra=["--chat-template-file", str(TEMPLATE)]) as s:
        yield s


def start(server: LlamaServer, tmp_path: Path, **settings: Any) -> Proxy:
    return Proxy(Settings(backends=(BackendConfig(server.url, None, server.slot_save_path),),
                          meta_dir=str(tmp_path / "meta"), host="127.0.0.1", **settings))


def tokens(server: LlamaServer, s: Session, turn: int) -> list[int]:
    """The prompt tokens llama-server makes of a request (its template, then its tokenizer)."""
    text = httpx.post(f"{server.url}/apply-template", json=s.chat(turn), timeout=60).json()["prompt"]
    return httpx.post(f"{server.url}/tokenize", json={"content": text, "add_special": True},
                      timeout=60).json()["tokens"]


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def send(proxy: Proxy, s: Session, headers: dict[str, str], turn: int = 0) -> Any:
    r = proxy.client.post("/v1/messages", json=s.body(turn, max_tokens=4), headers=headers, timeout=600)
    assert r.status_code == 200, r.text
    proxy.settle()
    return proxy.records[-1]


def test_a_sub_agent_starts_from_its_parents_saved_harness(server: LlamaServer, tmp_path: Path) -> None:
    proxy = start(server, tmp_path)
    try:
        parent, child, x, y = sessions(4, steps=1, seed=61, apis=("messages",))
        harness = shared(tokens(server, parent, 0), tokens(server, child, 0))
        assert harness > 2000
        root = send(proxy, parent, {"X-Claude-Code-Session-Id": ROOT})
        assert root.session_source == "x-claude-code-session-id" and root.seeded is None
        # two other conversations (prefix mode, another task each, a few words) take both slots: the harness is
        # left only in the parent's file
        for other in (x, y):
            short = {"model": other.model, "max_tokens": 4,
                     "messages": [{"role": "user", "content": other.task[:200]}]}
            assert proxy.client.post("/v1/messages", json=short, timeout=600).status_code == 200
            proxy.settle()
        sub = send(proxy, child, {"X-Claude-Code-Session-Id": ROOT, "X-Claude-Code-Agent-Id": "a91c"})
        assert sub.session != root.session                     # a session of its own
        assert sub.seeded == "parent" and sub.restored is True
        assert sub.cache_n >= 0.9 * harness                    # the harness came from the parent's file
        assert sub.prompt_n <= sub.prompt_tokens - 0.9 * harness
    finally:
        proxy.stop()


def test_a_session_of_another_key_never_starts_from_that_harness(server: LlamaServer, tmp_path: Path) -> None:
    httpx.post(f"{server.url}/slots/0?action=erase", timeout=60)
    httpx.post(f"{server.url}/slots/1?action=erase", timeout=60)
    proxy = start(server, tmp_path, api_keys=(KEY_A, KEY_B))
    try:
        first, second, third = sessions(3, steps=1, seed=62, apis=("messages",))
        harness = shared(tokens(server, first, 0), tokens(server, second, 0))
        a = send(proxy, first, {"Authorization": f"Bearer {KEY_A}", "X-Session-ID": "task-1"})
        b = send(proxy, second, {"Authorization": f"Bearer {KEY_B}", "X-Session-ID": "task-1"})
        assert b.slot != a.slot and b.seeded is None and b.restored is not True
        assert b.cache_n < 0.1 * harness                       # computed: key A's cache was not used
        again = send(proxy, third, {"Authorization": f"Bearer {KEY_A}", "X-Session-ID": "task-2"})
        assert again.seeded == "resident" and again.slot == a.slot
        assert again.cache_n >= 0.9 * harness
    finally:
        proxy.stop()
