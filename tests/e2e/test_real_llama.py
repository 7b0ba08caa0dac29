"""lpcache in front of a real llama-server (build 11434) with SmolLM2-135M: restore, streaming, disconnects.

These are slow (a long prompt costs seconds of prefill on 2 cores) and run in CI. The llama-server build and the
model come from scripts/get-llama-server.sh, cached outside the checkout.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads.harness import LlamaServer, story

from ..conftest import Proxy

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a careful reader. Answer briefly."}


def conversation(seed: int, n_words: int = 1400) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": story(seed, n_words) + "\nWho is in this story?"}]


def follow_up(first: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Where does it happen?"}]


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "llama.cpp", "messages": messages, "max_tokens": 24, "temperature": 0, **extra}


def tokens(server: str, messages: list[dict[str, Any]]) -> list[int]:
    """The exact tokens llama-server computes for a chat prompt: /apply-template, then /tokenize."""
    prompt = httpx.post(f"{server}/apply-template", json={"messages": messages}, timeout=60).json()["prompt"]
    return httpx.post(f"{server}/tokenize", json={"content": prompt, "add_special": True},
                      timeout=60).json()["tokens"]  # type: ignore[no-any-return]


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def stream_events(raw: bytes) -> list[bytes]:
    """SSE events without what differs between two runs of the same request: ids, timestamps, measured times."""
    volatile = re.compile(rb'"(id|created|system_fingerprint)":("[^"]*"|\d+)|"[a-z_]*(ms|per_second)":[0-9.e+-]+')
    return [volatile.sub(b"", e) for e in raw.split(b"\n\n") if e]


def stream(url: str, payload: dict[str, Any]) -> tuple[bytes, float]:
    """POST a streamed chat; returns the raw bytes and the seconds to the first content token."""
    started, first = time.perf_counter(), None
    raw = bytearray()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**payload, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            if first is None and b'"content":"' in chunk:
                first = time.perf_counter() - started
            raw += chunk
    assert first is not None
    return bytes(raw), first


def text_of(raw: bytes) -> str:
    import orjson

    parts = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def last_timings(raw: bytes) -> dict[str, Any]:
    import orjson

    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    return events[-1]["timings"]  # type: ignore[no-any-return]


def erase_all(url: str) -> None:
    for slot in (0, 1):
        assert httpx.post(f"{url}/slots/{slot}?action=erase", timeout=60).status_code == 200


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """-np 2, the RAM prompt cache off: only lpcache's disk caches can bring a pushed-out prompt back."""
    with LlamaServer(str(tmp_path_factory.mktemp("slots")), n_slots=2, cache_ram=0) as server:
        yield server


def start_proxy(llama: LlamaServer, meta_dir: str) -> Proxy:
    return Proxy(Settings(backends=(BackendConfig(llama.url, None, llama.slot_save_path),), meta_dir=meta_dir,
                          host="127.0.0.1"))


def test_pushed_out_conversation_is_restored_exactly(llama: LlamaServer, tmp_path: Any) -> None:
    first = conversation(1)
    first_tokens = tokens(llama.url, first)
    assert len(first_tokens) >= 1500

    # Reference: the same two requests straight to llama-server, the first prompt staying resident in slot 0.
    erase_all(llama.url)
    answer = httpx.post(f"{llama.url}/v1/chat/completions", json=body(first, id_slot=0), timeout=600)
    answer_text = answer.json()["choices"][0]["message"]["content"]
    second = follow_up(first, answer_text)
    resident_raw, _ = stream(llama.url, body(second, id_slot=0))
    assert last_timings(resident_raw)["cache_n"] > 1500   # the reference really reused the resident slot

    # Through lpcache: the conversation, two others that take both slots, then the conversation again.
    erase_all(llama.url)
    proxy = start_proxy(llama, str(tmp_path / "meta"))
    try:
        r = proxy.post(body(first))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == answer_text
        for seed in (2, 3):
            assert proxy.post(body(conversation(seed))).status_code == 200
        proxy.settle()
        saved = proxy.records[0].save_file
        assert all(s.content is not None and s.content.key != saved for s in proxy.pipeline.pool.slots)

        restored_raw, restored_ttft = stream(proxy.url, body(second))
        proxy.wait_finished(4)
        record = proxy.records[3]
        assert record.restored is True

        timings = last_timings(restored_raw)
        second_tokens = tokens(llama.url, second)
        common = shared(first_tokens, second_tokens)
        assert timings["cache_n"] >= 0.9 * common
        assert timings["prompt_n"] <= len(second_tokens) - common + 1   # only the new part is computed
        # A restore reproduces the slot exactly: same answer, same events as with the prompt left resident.
        assert text_of(restored_raw) == text_of(resident_raw)
        assert stream_events(restored_raw) == stream_events(resident_raw)
    finally:
        proxy.stop()

    # Without lpcache (RAM cache off, the conversation pushed out): the whole prompt is computed again.
    erase_all(llama.url)
    direct_raw, direct_ttft = stream(llama.url, body(second))
    assert last_timings(direct_raw)["prompt_n"] >= len(second_tokens) - 1
    assert restored_ttft < direct_ttft
    print(f"\nrestored: cache_n={timings['cache_n']} prompt_n={timings['prompt_n']} ttft={restored_ttft:.2f}s; "
          f"straight to llama-server: prompt_n={last_timings(direct_raw)['prompt_n']} ttft={direct_ttft:.2f}s")


def test_client_leaving_mid_stream_frees_and_saves_the_slot(llama: LlamaServer, tmp_path: Any) -> None:
    erase_all(llama.url)
    proxy = start_proxy(llama, str(tmp_path / "meta"))
    try:
        messages = conversation(4, 700)
        with proxy.client.stream("POST", "/v1/chat/completions", json=body(messages, max_tokens=400, stream=True)) as r:
            for chunk in r.iter_raw():
                if b'"content":"' in chunk:
                    break   # leave after the first token
        proxy.wait_finished(1)
        record = proxy.records[0]
        assert record.reason == "client_disconnected"
        assert record.saved is True
        assert record.save_file and os.path.exists(os.path.join(llama.slot_save_path or "", record.save_file))
        assert proxy.busy_slots() == []
        # The next request for that slot is served at once, and finds the saved prefix in it.
        again = proxy.post(body(messages, max_tokens=4))
        assert again.status_code == 200
        assert again.json()["timings"]["cache_n"] > 700
    finally:
        proxy.stop()


def test_with_the_default_ram_cache_a_pushed_out_conversation_still_comes_back(tmp_path: Any) -> None:
    """The server's own RAM cache (default --cache-ram) and lpcache's pinning work together."""
    with LlamaServer(str(tmp_path / "slots"), n_slots=2, cache_ram=None) as server:
        proxy = start_proxy(server, str(tmp_path / "meta"))
        try:
            first = conversation(5, 900)
            answer = proxy.post(body(first)).json()["choices"][0]["message"]["content"]
            for seed in (6, 7):
                proxy.post(body(conversation(seed, 900)))
            second = follow_up(first, answer)
            r = proxy.post(body(second))
            common = shared(tokens(server.url, first), tokens(server.url, second))
            assert r.status_code == 200
            assert r.json()["timings"]["cache_n"] >= 0.9 * common
        finally:
            proxy.stop()


@pytest.mark.parametrize("during", ["prefill", "generation"])
def test_json_client_hanging_up_stops_generation_and_frees_the_slot(llama: LlamaServer, tmp_path: Any,
                                                                    during: str) -> None:
    """What the stand-in imitates: llama-server stops a JSON request whose client hung up. The slot's cache is
    saved only when the server had read the whole prompt (it had started generating: GET /slots n_decoded; a client
    leaving during the prefill is noticed by llama-server only after it), never a partial prefill as if it held the
    prompt; and lpcache lets go of the slot only once the server has."""
    import json as _json
    import socket

    erase_all(llama.url)
    proxy = start_proxy(llama, str(tmp_path / "meta"))
    try:
        messages = conversation(8, 700)
        payload = _json.dumps(body(messages, max_tokens=4000, ignore_eos=True)).encode()
        sock = socket.create_connection(("127.0.0.1", proxy.server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        # Wait until llama-server is reading the prompt, or generating, then hang up.
        deadline = time.monotonic() + 120

        def ready() -> bool:
            slots = [s for s in httpx.get(f"{llama.url}/slots").json() if s["is_processing"]]
            decoded = [s["next_token"][0]["n_decoded"] for s in slots]
            return bool(slots) and (during == "prefill" or decoded[0] > 0)

        while not ready():
            assert time.monotonic() < deadline
        sock.close()
        proxy.wait_finished(1, timeout=120)
        record = proxy.records[0]
        assert record.reason == "client_disconnected"
        assert proxy.busy_slots() == []
        assert not any(s["is_processing"] for s in httpx.get(f"{llama.url}/slots").json())
        if during == "generation":
            assert record.saved
        if record.saved:                     # then what it saved holds the whole prompt, never a part of it
            proxy.settle()
            entry = proxy.pipeline.index.get(record.save_file or "")
            assert entry is not None and entry.n_tokens is not None
            assert entry.n_tokens >= len(tokens(llama.url, messages))
    finally:
        proxy.stop()


def test_two_servers_serve_each_conversation_where_its_cache_is(tmp_path: Any) -> None:
    """Two llama-servers (-np 2, --cache-ram 0, separate slot-save folders), four conversations taking turns."""
    with LlamaServer(str(tmp_path / "slots-a"), n_slots=2, cache_ram=0) as a, \
            LlamaServer(str(tmp_path / "slots-b"), n_slots=2, cache_ram=0) as b:
        proxy = Proxy(Settings(backends=(BackendConfig(a.url, None, a.slot_save_path),
                                         BackendConfig(b.url, None, b.slot_save_path)),
                               meta_dir=str(tmp_path / "meta"), host="127.0.0.1"))
        try:
            talks = [conversation(20 + i, 560) for i in range(4)]
            where: dict[int, set[str]] = {i: set() for i in range(4)}
            sent: dict[int, list[dict[str, Any]]] = {}
            for turn in range(3):
                for i in range(4):
                    r = proxy.post(body(talks[i], max_tokens=12))
                    assert r.status_code == 200
                    where[i].add(r.headers["x-lpcache-slot"])
                    if turn > 0:
                        common = shared(tokens(a.url, sent[i]), tokens(a.url, talks[i]))
                        assert r.json()["timings"]["cache_n"] >= 0.9 * common, (i, turn)
                    sent[i] = talks[i]
                    talks[i] = follow_up(talks[i], r.json()["choices"][0]["message"]["content"])
            backends_used = {slot.split(":")[0] for slots in where.values() for slot in slots}
            assert backends_used == {"0", "1"}
            assert all(len(slots) == 1 for slots in where.values())   # each conversation stayed where its cache is
        finally:
            proxy.stop()


def test_request_log_carries_the_real_servers_figures(llama: LlamaServer, tmp_path: Any) -> None:
    log_path = tmp_path / "req.log"
    erase_all(llama.url)
    proxy = Proxy(Settings(backends=(BackendConfig(llama.url, None, llama.slot_save_path),),
                           meta_dir=str(tmp_path / "meta"), host="127.0.0.1",
                           plugins=({"name": "request_log", "params": {"path": str(log_path)}},)))
    try:
        first = conversation(30, 600)
        answer = proxy.post(body(first)).json()["choices"][0]["message"]["content"]
        stream(proxy.url, body(follow_up(first, answer)))
        proxy.wait_finished(2)
    finally:
        proxy.stop()
    lines = log_path.read_text().splitlines()
    fields = lines[3].removeprefix("#Fields: ").split()
    rows = [dict(zip(fields, line.split(" "), strict=True)) for line in lines[4:]]
    assert len(rows) == 2
    first_row, second_row = rows
    assert int(first_row["lpcache-prompt-tokens"]) > 600 and int(first_row["lpcache-completion-tokens"]) > 0
    assert float(first_row["lpcache-prefill-ms"]) > 0 and float(first_row["lpcache-prefill-tps"]) > 0
    assert second_row["lpcache-stream"] == "true" and float(second_row["lpcache-ttft-ms"]) > 0
    # the second turn found the first in its slot: most of its prompt tokens came from the cache
    assert int(second_row["lpcache-cached-tokens"]) > 0.9 * int(first_row["lpcache-prompt-tokens"])
