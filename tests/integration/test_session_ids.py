"""X-Session-ID values through lpcache in front of the stand-in: any printable id is a session (hashed to lpcache's
32-hex form, which names its file and comes back in `x-lpcache-session` on every API, JSON and streamed); a value
that cannot be a session is served in prefix mode, warned about once and counted in /metrics."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from lpcache.cache.meta_files import prefix_file
from lpcache.cache.sessions import session_filename

from ..conftest import user, words
from .conftest import STAND_IN_FP, Proxy, mock_stats

BIG = 200          # words: big with the test threshold of 50
ROUTE = "llama.cpp"


def sha32(value: str | bytes) -> str:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).hexdigest()[:32]


def story(seed: int) -> str:
    return (f"Chapitre {seed}: « Où est passée la clé ? » demanda Zoë. Ölüdeniz, 東京, naïve café — "
            + words(seed, BIG))


@pytest.mark.parametrize("value", [
    "6F9619FF-8B86-D011-B42D-00C04FC964FF",
    "user-42",
    "Zoë Ångström / редактор, 李小龙".encode(),    # UTF-8 on the wire, as a client sends a name
])
def test_any_printable_id_is_a_session_with_a_file_of_its_own(start_proxy: Any, start_backend: Any, slot_dir: str,
                                                               value: str | bytes) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend)
    sid = sha32(value)
    first = proxy.push(user(story(1)), {"X-Session-ID": value})
    assert first.status_code == 200 and first.headers["x-lpcache-session"] == sid
    proxy.push(user(story(2)), {"X-Session-ID": "another one, Ärger inklusive".encode()})
    before = mock_stats(backend)["restores"]
    again = proxy.push(user(story(1) + " Und dann?"), {"X-Session-ID": value})
    assert again.headers["x-lpcache-session"] == sid and again.headers["x-lpcache-restored"] == "true"
    assert mock_stats(backend)["restores"] == before + 1
    assert again.json()["timings"]["cache_n"] >= BIG                  # the session's file brought the story back
    assert session_filename(ROUTE, sid, STAND_IN_FP) in os.listdir(slot_dir)
    assert proxy.records[-1].session == sid
    assert {s["session"] for s in proxy.client.get("/lpcache/sessions").json()["data"]} == {
        sid, sha32("another one, Ärger inklusive")}


def test_the_strict_form_keeps_its_file_name(start_proxy: Any, start_backend: Any, slot_dir: str) -> None:
    proxy = start_proxy(start_backend(slots=1))
    sid = "3f9a0c1d5b7e4a2c8d6f1e0b9a7c5d3e"
    r = proxy.push(user(story(3)), {"X-Session-ID": sid})
    assert r.headers["x-lpcache-session"] == sid
    assert os.listdir(slot_dir) == [session_filename(ROUTE, sid, STAND_IN_FP)]   # existing files still restore
    metrics = proxy.client.get("/metrics").text
    assert "lpcache_session_ids_hashed_total 0.0" in metrics


CHAT = {"messages": user(story(4)), "max_tokens": 3}
APIS = {
    "/v1/chat/completions": CHAT,
    "/v1/responses": {"input": story(4), "max_output_tokens": 3},
    "/v1/messages": {"model": "m", "max_tokens": 3, "messages": user(story(4))},
    "/v1/completions": {"prompt": story(4), "max_tokens": 3},
    "/completion": {"prompt": story(4), "n_predict": 3},
    "/infill": {"input_extra": [{"filename": "notes.md", "text": story(4)}], "input_prefix": "def f(x):\n    ",
                "input_suffix": "\n", "n_predict": 3},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", list(APIS))
def test_every_api_answers_which_session_it_used(start_proxy: Any, start_backend: Any, path: str,
                                                stream: bool) -> None:
    proxy = start_proxy(start_backend(slots=1))
    value = "dev-Łukasz#7"
    r = proxy.client.post(path, json={**APIS[path], "stream": stream}, headers={"X-Session-ID": value.encode()})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream" if stream else "application/json")
    assert r.headers["x-lpcache-session"] == sha32(value)
    without = proxy.client.post(path, json={**APIS[path], "stream": stream})
    assert without.status_code == 200 and "x-lpcache-session" not in without.headers   # prefix mode: none


def test_a_coalesced_follower_says_its_session_too(start_proxy: Any, start_backend: Any) -> None:
    backend = start_backend(gen_ms_per_token=40)              # 30 tokens: over a second to generate
    proxy = start_proxy(backend, coalesce_requests=True)
    body = {"messages": user("Erzähl mir von Köln."), "max_tokens": 30, "temperature": 0}

    def send() -> httpx.Response:
        return proxy.client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "user-42"})

    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(send)
        deadline = time.monotonic() + 20
        while len(proxy.pipeline.coalescer) == 0:              # the leader's group is open
            assert time.monotonic() < deadline
            time.sleep(0.005)
        follower = pool.submit(send).result()
        first = leader.result()
    assert follower.headers["x-lpcache-coalesced"] == "true"
    assert first.headers["x-lpcache-session"] == follower.headers["x-lpcache-session"] == sha32("user-42")
    assert mock_stats(backend)["chat_requests"] == 1


def test_a_value_that_cannot_be_a_session_is_prefix_mode_warned_once_and_counted(
        start_proxy: Any, start_backend: Any, slot_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    proxy = start_proxy(start_backend(slots=1))
    bad: list[str | bytes] = ["user\t42", "user\t42", "x" * 257, "", b"Zo\xeb"]
    with caplog.at_level(logging.WARNING, "lpcache.pipeline"):
        for i, value in enumerate(bad):
            r = proxy.push(user(story(10 + i)), {"X-Session-ID": value})
            assert r.status_code == 200 and "x-lpcache-session" not in r.headers
            assert proxy.records[-1].session is None
            assert prefix_file(proxy.records[-1].key, STAND_IN_FP) in os.listdir(slot_dir)   # the prefix-mode name
    lines = [r.getMessage() for r in caplog.records if "session_id_rejected" in r.getMessage()]
    assert [re.search(r"reason=(\w+)", line).group(1) for line in lines] == [
        "control_character", "too_long", "empty", "not_utf8"]                  # the repeated value: once
    assert all("user\t42" not in line and "xxxxxxxx" not in line for line in lines)
    assert all(not name.endswith(f"_{sha32(v)}.bin") for name in os.listdir(slot_dir) for v in bad)
    assert proxy.client.get("/lpcache/sessions").json()["data"] == []
    metrics = proxy.client.get("/metrics").text
    for reason, count in (("control_character", 2), ("too_long", 1), ("empty", 1), ("not_utf8", 1)):
        assert f'lpcache_session_ids_rejected_total{{reason="{reason}"}} {count}.0' in metrics, reason


def test_the_comparison_takes_the_id_the_client_sent(start_proxy: Any, start_backend: Any) -> None:
    proxy: Proxy = start_proxy(start_backend(slots=1))
    value = "team/alice: Kapitel 3"
    for text in (story(5), story(5) + " — und weiter."):
        proxy.push(user(text), {"X-Session-ID": value})
    doc = proxy.client.get(f"/lpcache/sessions/{quote(value, safe='')}/compare").json()
    assert doc["session"] == sha32(value) and doc["requests"] == 2
    assert proxy.client.get(f"/lpcache/sessions/{sha32(value)}/compare").json()["session"] == sha32(value)
    too_long = proxy.client.get(f"/lpcache/sessions/{'y' * 300}/compare")
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "invalid_session_id"
    assert "too_long" in too_long.json()["error"]["message"]


def test_a_router_keeps_one_file_per_model_for_a_hashed_id(start_proxy: Any, start_backend: Any,
                                                          slot_dir: str) -> None:
    router = start_backend(router=True, models=("qwen-écrit", "gemma-lektor"), slots=1, models_max=1)
    proxy = start_proxy(router, models_max=1)         # lpcache follows the router's unloads
    sid = sha32("user-42")
    for model in ("qwen-écrit", "gemma-lektor", "qwen-écrit"):
        r = proxy.push(user(story(20)), {"X-Session-ID": "user-42"}, model=model)
        assert r.status_code == 200, r.text
        assert r.headers["x-lpcache-session"] == sid
    names = sorted(n for n in os.listdir(slot_dir) if n.endswith(f"_{sid}.bin"))
    assert [n.split("-", 1)[0] for n in names] == ["gemma", "qwen"]    # the models never share a file
    assert r.headers["x-lpcache-restored"] == "true"                    # the router unloaded it; its file came back
