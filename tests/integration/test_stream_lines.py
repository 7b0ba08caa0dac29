"""Every line of every stream lpcache sends is one a strict OpenAI-style reader takes (`tests/openai_stream.py`), also
when the backend sends keep-alive comments: llama-server (b11434) sends `:` after `sse_ping_interval` seconds
(30 by default) without an event, during a long prefill or between slow tokens. Here the stand-in is asked to send
them every 20 ms, so that its prefills and tokens outlast them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import user, words
from ..openai_stream import read_strictly
from .conftest import mock_stats

PING = 0.02   # seconds of silence before the stand-in's keep-alive


def fault(backend: Any, **faults: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json=faults).raise_for_status()


def stream(client: httpx.Client, messages: list[dict[str, Any]], session: str | None = None,
           **extra: Any) -> httpx.Response:
    headers = {"X-Session-ID": session} if session else None
    return client.post("/v1/chat/completions", headers=headers, json={
        "messages": messages, "stream": True, "max_tokens": 6, "temperature": 0, "sse_ping_interval": PING,
        **extra})


def test_the_stand_in_sends_keepalives_for_these_bodies(start_backend: Any) -> None:
    """What the tests below rely on: the backend's own streams hold comment lines."""
    backend = start_backend(prefill_ms_per_token=1, gen_ms_per_token=30)
    with httpx.Client(base_url=backend.url, timeout=30) as client:
        raw = stream(client, user(words(1, 100))).content
    assert raw.count(b":\n\n") >= 3 and raw.endswith(b"data: [DONE]\n\n"), raw
    with pytest.raises(AssertionError, match="is not 'data: ...'"):
        read_strictly(raw)


def test_concurrent_sessions_with_every_turn_saved_stream_only_data_lines(start_backend: Any,
                                                                         start_proxy: Any) -> None:
    """Six conversations on two slots, four at once, each turn sent as soon as the previous answer ended, with the
    answers fed back; every turn is big (saved), each conversation has its X-Session-ID."""
    backend = start_backend(slots=2, prefill_ms_per_token=1, gen_ms_per_token=30)
    proxy = start_proxy(backend, big_threshold_words=0, words_per_block=10, meta_max=0)

    def conversation(k: int) -> int:
        history: list[dict[str, Any]] = []
        for turn in range(3):
            history += user(words(10 * k + turn, 40 + 20 * turn))
            r = stream(proxy.client, history, session=f"conversation-{k}")
            assert r.status_code == 200, r.text
            answer = read_strictly(r.content)
            assert answer.done and answer.content
            history.append({"role": "assistant", "content": answer.content})
        return len(history)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(conversation, range(6))) == [6] * 6
    proxy.wait_finished(18)
    assert all(rec.status == 200 and rec.saved and rec.ttft_ms is not None for rec in proxy.records)
    assert proxy.busy_slots() == []


def test_a_stream_that_breaks_after_keepalives_only_is_sent_again(start_backend: Any, start_proxy: Any) -> None:
    """The backend sends keep-alives during the prefill, then the connection breaks: no part of the answer went
    out (a comment is none), so the request is sent again and the client gets one whole answer."""
    backend = start_backend(slots=2, prefill_ms_per_token=2)
    proxy = start_proxy(backend, request_timeout=5.0)
    fault(backend, stream_break_after=1, stream_break_count=1)   # its first event: a keep-alive
    r = stream(proxy.client, user(words(1, 100)))
    assert r.status_code == 200
    answer = read_strictly(r.content)
    assert answer.done and answer.content
    proxy.wait_finished(1)
    assert proxy.records[0].retries == 1 and proxy.records[0].reason is None
    assert mock_stats(backend)["chat_requests"] == 2


@pytest.mark.parametrize("path", ["coalesced", "result_cache"])
def test_other_streaming_paths_stream_only_data_lines(start_backend: Any, start_proxy: Any, tmp_path: Path,
                                                      path: str) -> None:
    """A coalesced follower gets what its leader's client got; a result served from the cache is a stream made by
    lpcache; both with keep-alives upstream."""
    backend = start_backend(slots=2, prefill_ms_per_token=2, gen_ms_per_token=30)
    plugins = ({"name": "result_cache", "params": {"dir": str(tmp_path / "results"), "cache_streaming": True}},)
    proxy = start_proxy(backend, coalesce_requests=path == "coalesced",
                        plugins=plugins if path == "result_cache" else ())
    messages = user(words(2, 100))
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: stream(proxy.client, messages), range(3)))
    proxy.settle()
    if path == "result_cache":
        answers.append(stream(proxy.client, messages))
        assert answers[-1].headers.get("x-lpcache-served-by") == "prefilter"
    else:
        assert sum(r.headers.get("x-lpcache-coalesced") == "true" for r in answers) >= 1
    texts = {read_strictly(r.content).content for r in answers}
    assert len(texts) == 1 and texts.pop()


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_stream_broken_after_bytes_went_out_ends_with_one_error_event(start_backend: Any, start_proxy: Any,
                                                                        coalesced: bool) -> None:
    """The backend breaks halfway through an event after some went out: the client (and a coalesced follower) gets
    the whole events, then lpcache's error event as its last line, the documented end of a stream that broke."""
    backend = start_backend(slots=2, gen_ms_per_token=30)   # the head at once, then a keep-alive before each token
    proxy = start_proxy(backend, request_timeout=5.0, coalesce_requests=coalesced)
    fault(backend, stream_break_after=6, stream_break_count=1, stream_break_half=True)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: stream(proxy.client, user(words(3, 100)), max_tokens=20),
                                range(1 + coalesced)))
    broken = [read_strictly(r.content, broken_ok=True) for r in answers]
    assert any(s.error is not None for s in broken)
    for s in broken:
        if s.error is not None:
            assert not s.done and s.error["type"] == "backend_unreachable" and s.error["code"] == 502
    proxy.wait_finished(len(answers))
    assert proxy.busy_slots() == []
