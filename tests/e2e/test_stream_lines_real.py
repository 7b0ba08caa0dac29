"""Streams through lpcache from a real llama-server (b11434, SmolLM2-135M, -np 2 --cache-ram 0) read the way a
strict OpenAI-style client reads them (vLLM's multi-turn benchmark, `tests/openai_stream.py`): concurrent
multi-turn conversations with their X-Session-ID, every turn saved, each next turn sent as soon as the answer
ended, the server's answers fed back.

llama-server sends a keep-alive comment (`:`) after `sse_ping_interval` seconds without an event, 30 by default: on
a loaded machine a prefill or a token can take that long (two of 75 streams of vLLM's benchmark, issue 21). Here the
requests ask for 1 s, so that the first turns' prefills (about 1,500 tokens) outlast it on any machine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads.harness import LlamaServer, story

from ..conftest import Proxy
from ..openai_stream import read_strictly

pytestmark = pytest.mark.e2e

QUESTIONS = ("Who is in this story?", "Where does it happen?", "What happens last?")


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "smollm2", "messages": messages, "stream": True, "stream_options": {"include_usage": False},
            "max_tokens": 16, "min_tokens": 16, "temperature": 0, "sse_ping_interval": 1}


def first_turn(k: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": story(k, 900) + "\n" + QUESTIONS[0]}]


def test_concurrent_sessions_with_every_turn_saved_stream_only_data_lines(tmp_path: Path) -> None:
    with LlamaServer(str(tmp_path / "slots"), n_slots=2, cache_ram=0, ctx=8192) as server:
        # What makes the test able to fail: the server's own stream of a long prompt holds keep-alives.
        long = [{"role": "user", "content": story(99, 2000) + "\n" + QUESTIONS[0]}]
        raw = httpx.post(f"{server.url}/v1/chat/completions", json=body(long), timeout=600).content
        assert b"\n:\n\n" in b"\n" + raw, raw[:500]
        proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, server.slot_save_path),),
                               meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=0,
                               words_per_block=10, meta_max=0))
        try:
            def conversation(k: int) -> int:
                history = first_turn(k)
                for turn in range(len(QUESTIONS)):
                    if turn:
                        history.append({"role": "user", "content": QUESTIONS[turn]})
                    r = proxy.client.post("/v1/chat/completions", json=body(history),
                                          headers={"X-Session-ID": f"conversation-{k}"})
                    assert r.status_code == 200, r.text
                    answer = read_strictly(r.content)
                    assert answer.done
                    history.append({"role": "assistant", "content": answer.content})
                return turn + 1

            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(conversation, range(4))) == [len(QUESTIONS)] * 4
            proxy.wait_finished(4 * len(QUESTIONS), timeout=300)
            records = list(proxy.records)
        finally:
            proxy.stop()
    assert all(rec.status == 200 and rec.saved for rec in records), [(r.status, r.saved) for r in records]
    assert sum(1 for rec in records if rec.restored) >= 1   # the sessions were swapped in and out of the slots


def test_a_request_right_after_a_streamed_answer_never_meets_its_closed_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """llama-server b11434 closes a streamed answer's connection after its last event although it answers
    keep-alive (shown here first: a client that sends its next request on it fails). Through lpcache, a plain
    request sent the moment each streamed answer ends goes out on a live connection, once: no stale connection,
    no failover, no retry."""
    import http.client
    import json
    import logging

    with LlamaServer(str(tmp_path / "slots"), n_slots=2, cache_ram=0, ctx=8192) as server:
        direct = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        short = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
        direct.request("POST", "/v1/chat/completions", json.dumps({**short, "stream": True}),
                       {"Content-Type": "application/json"})
        first = direct.getresponse()
        first.read()
        assert first.getheader("Keep-Alive"), "it answers keep-alive"
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            direct.request("POST", "/v1/chat/completions", json.dumps(short), {"Content-Type": "application/json"})
            direct.getresponse().read()
        direct.close()
        proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, server.slot_save_path),),
                               meta_dir=str(tmp_path / "meta"), host="127.0.0.1"))
        try:
            with caplog.at_level(logging.INFO):
                for i in range(12):
                    r = proxy.client.post("/v1/chat/completions", json={**short, "stream": i % 2 == 0,
                                                                        "temperature": 0})
                    assert r.status_code == 200, r.text
            assert "stale_connection" not in caplog.text and "failover" not in caplog.text, caplog.text[-2000:]
            assert sum(r.retries for r in proxy.records) == 0
        finally:
            proxy.stop()
