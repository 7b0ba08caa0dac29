"""bench/bare_proxy.py, the hop the ShareGPT bench's `bare-RAM` setups put in lpcache's place: as a process of its
own in front of the stand-in, it passes requests and answers on unchanged (a stream event by event, errors with
their status), so what it adds to a run is the hop alone."""

from __future__ import annotations

import json

import httpx

from lpcache.mock_llama import MockHandle

from ..conftest import load_bench, words

bare = load_bench("bare_proxy")


def _events(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("data: ")]


def _choices(text: str) -> list[object]:
    """Each event's choices (its id, time and timings change from one answer to the next)."""
    return [json.loads(e[6:]).get("choices") if e != "data: [DONE]" else e for e in _events(text)]


def test_a_stream_and_an_error_pass_through_unchanged(backend: MockHandle) -> None:
    proxy = bare.BareProxy(backend.url)
    try:
        body = {"messages": [{"role": "user", "content": "Ünïcode, `code()` and " + words(7, 40)}],
                "max_tokens": 8, "stream": True, "temperature": 0}
        direct = httpx.post(f"{backend.url}/v1/chat/completions", json=body, timeout=30)
        through = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=30)
        assert through.status_code == direct.status_code == 200
        assert through.headers["content-type"].startswith("text/event-stream")
        assert _choices(through.text) == _choices(direct.text)
        assert len(_choices(through.text)) > 8   # a token an event, then the end
        assert _events(through.text)[-1] == "data: [DONE]"

        bad = httpx.post(f"{proxy.url}/v1/chat/completions", content=b"{not json", timeout=30,
                         headers={"Content-Type": "application/json"})
        assert bad.status_code == httpx.post(f"{backend.url}/v1/chat/completions", content=b"{not json",
                                             headers={"Content-Type": "application/json"}).status_code >= 400
        assert "error" in bad.json()
        assert httpx.get(f"{proxy.url}/health", timeout=30).status_code == 200
    finally:
        proxy.stop()
    assert proxy.process.returncode is not None
