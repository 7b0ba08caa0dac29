"""lpcache end to end against the stand-in llama-server: the cache pipeline, streaming, errors, slots."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig

from ..conftest import Proxy, user, words
from .conftest import mock_stats

BIG = 200    # words: big with the test threshold of 50 (20 blocks of 10 words)
SMALL = 20


def meta_files(proxy: Proxy) -> list[str]:
    d = proxy.settings.meta_dir
    return sorted(f for f in os.listdir(d) if f.endswith(".meta.json")) if os.path.isdir(d) else []


def test_small_request_is_pinned_but_not_saved(proxy: Proxy, backend: Any) -> None:
    r = proxy.chat(user(words(1, SMALL)))
    proxy.settle()
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-lpcache-slot"] in ("0:0", "0:1")
    stats = mock_stats(backend)
    assert stats["saves"] == 0 and stats["restores"] == 0
    assert meta_files(proxy) == []


def test_big_request_saves_its_cache_and_writes_meta(proxy: Proxy, backend: Any, slot_dir: str) -> None:
    r = proxy.chat(user(words(1, BIG)))
    proxy.settle()
    assert r.status_code == 200
    [name] = meta_files(proxy)
    key = name.removesuffix(".meta.json")
    with open(os.path.join(proxy.settings.meta_dir, name)) as f:
        meta = json.load(f)
    assert meta["model_id"] == "llama.cpp" and meta["wpb"] == 10 and len(meta["blocks"]) == BIG // 10
    assert meta["timestamp"] > 0
    assert os.path.exists(os.path.join(slot_dir, key))          # the KV file, named by the key
    assert mock_stats(backend)["saves"] == 1
    assert proxy.busy_slots() == []


def test_second_big_request_restores_after_slots_were_taken(proxy: Proxy, backend: Any) -> None:
    first = words(1, BIG)
    proxy.push(user(first))
    proxy.push(user(words(2, BIG)))
    proxy.push(user(words(3, BIG)))    # both slots now hold other conversations
    proxy.settle()
    r = proxy.chat(user(first + " and a few more words"))
    proxy.settle()
    assert r.status_code == 200
    assert r.headers["x-lpcache-restored"] == "true"
    timings = r.json()["timings"]
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert timings["cache_n"] >= 0.9 * (prompt_tokens - 10)    # all but the new words came from the restore
    assert mock_stats(backend)["restores"] == 1


def test_resident_prefix_is_reused_without_restore(proxy: Proxy, backend: Any) -> None:
    first = words(1, BIG)
    proxy.chat(user(first))
    proxy.settle()
    r = proxy.chat(user(first + " more"))
    assert r.headers["x-lpcache-restored"] == "false"
    assert r.headers["x-lpcache-cache-hit"] == "true"
    assert r.json()["timings"]["cache_n"] > BIG
    assert mock_stats(backend)["restores"] == 0


def test_longest_prefix_wins_over_a_short_shared_system_prompt(proxy: Proxy, backend: Any) -> None:
    system = {"role": "system", "content": words(9, 60)}
    long_conv = [system, {"role": "user", "content": words(1, BIG)}]
    proxy.push([system, {"role": "user", "content": words(7, 10)}])     # big: system prompt + a short question
    proxy.push(long_conv)
    proxy.push(user(words(2, BIG)))
    proxy.push(user(words(3, BIG)))
    proxy.settle()
    r = proxy.chat([*long_conv, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}])
    assert r.headers["x-lpcache-restored"] == "true"
    assert r.json()["timings"]["cache_n"] > BIG


# ids, timestamps, measured times, and the cache counts (the slot holds the prompt the second time)
_VOLATILE = re.compile(rb'"(id|created|system_fingerprint|cache_n|prompt_n|cached_tokens)":("[^"]*"|\d+)'
                       rb'|"[a-z_]*(ms|per_second)":[0-9.e+-]+')


def test_sse_is_passed_through_byte_for_byte(proxy: Proxy, backend: Any) -> None:
    body = {"messages": user(words(1, SMALL)), "stream": True, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True}}
    with proxy.client.stream("POST", "/v1/chat/completions", json=body) as r:
        via_proxy = b"".join(r.iter_raw())
        assert r.headers["content-type"].startswith("text/event-stream")
    proxy.settle()
    # The same request straight to the backend, to the slot lpcache used (same cache state: empty prompt reuse).
    direct_body = {**body, "id_slot": int(r.headers["x-lpcache-slot"].split(":")[1])}
    direct = httpx.post(f"{backend.url}/v1/chat/completions", json=direct_body, timeout=30).content
    assert via_proxy.endswith(b"data: [DONE]\n\n")
    assert via_proxy.count(b"\n\n") == direct.count(b"\n\n") == 8 + 4   # role, 8 tokens, finish, usage, [DONE]
    strip = lambda raw: _VOLATILE.sub(b"", raw)  # noqa: E731
    assert strip(via_proxy) == strip(direct)


def test_stream_timings_are_recorded(proxy: Proxy, backend: Any) -> None:
    with proxy.client.stream("POST", "/v1/chat/completions",
                             json={"messages": user(words(1, BIG)), "stream": True, "max_tokens": 4}) as r:
        r.read()
    proxy.wait_finished(1)
    [rec] = proxy.records
    assert rec.status == 200 and rec.stream is True and rec.big is True and rec.saved is True
    assert rec.prompt_n is not None and rec.prompt_n > BIG and rec.ttft_ms is not None
    assert rec.bytes_out == len(r.content)


def test_client_disconnect_mid_stream_saves_and_frees_the_slot(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, gen_ms_per_token=20)
    proxy = start_proxy(backend)
    body = {"messages": user(words(1, BIG)), "stream": True, "max_tokens": 2000}
    with proxy.client.stream("POST", "/v1/chat/completions", json=body) as r:
        first = next(r.iter_raw())
        assert first.startswith(b"data: ")
    # The client left after its first chunk. lpcache closes the upstream, saves the slot, releases it.
    proxy.wait_finished(1)
    assert proxy.records[0].reason == "client_disconnected"
    assert proxy.busy_slots() == []
    assert mock_stats(backend)["saves"] == 1
    assert len(meta_files(proxy)) == 1
    # The one slot is free: the next request takes it without waiting.
    assert proxy.chat(user(words(2, SMALL)), max_tokens=1).status_code == 200
    proxy.wait_finished(2)
    assert proxy.records[1].slot == 0 and proxy.busy_slots() == []


def test_bad_json_is_422_in_openai_shape(proxy: Proxy) -> None:
    r = proxy.client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and "JSON" in err["message"]


@pytest.mark.parametrize("body, fragment", [
    ([1, 2], "JSON object"),
    ({"model": "x"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": 3}, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "'max_tokens' must be an integer >= 0"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "64"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n_predict": True}, "n_predict"),
])
def test_ill_formed_chat_bodies_are_400(proxy: Proxy, backend: Any, body: Any, fragment: str) -> None:
    r = proxy.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert fragment in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert mock_stats(backend)["chat_requests"] == 0
    assert proxy.busy_slots() == []


@pytest.mark.parametrize("limit", [-1, 0, 3, None])
def test_answer_lengths_llama_server_takes_pass(proxy: Proxy, limit: int | None) -> None:
    """-1 (until the context is full) and 0 are llama-server's own values: passed on."""
    r = proxy.chat(user(words(1, SMALL)), max_tokens=limit, n_predict=limit)
    assert r.status_code == 200, r.text


def test_backend_error_status_and_message_are_passed_on(proxy: Proxy, backend: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json={"status": 500, "status_count": 1})
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 500
    assert r.json()["error"]["message"]
    assert proxy.busy_slots() == []
    assert proxy.chat(user(words(1, SMALL))).status_code == 200


def test_backend_4xx_is_passed_on(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(n_ctx=64)
    proxy = start_proxy(backend)
    r = proxy.chat(user(words(1, BIG)))
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "exceed_context_size_error"
    proxy.settle()
    assert proxy.busy_slots() == [] and meta_files(proxy) == []


def test_unreachable_backend_is_502(start_proxy: Any) -> None:
    from lpcache.workloads.harness import free_port

    proxy = start_proxy(BackendConfig(f"http://127.0.0.1:{free_port()}", 2))
    r = proxy.chat(user(words(1, SMALL)))
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "backend_unreachable"
    assert proxy.busy_slots() == []


def test_backend_without_n_slots_is_asked_for_total_slots(start_backend: Any, start_proxy: Any) -> None:
    proxy = start_proxy(start_backend(slots=3))
    assert len(proxy.pipeline.pool.slots) == 3


def test_fifty_concurrent_requests_use_both_slots(proxy: Proxy, backend: Any) -> None:
    def one(i: int) -> int:
        return proxy.chat(user(words(i, SMALL)), max_tokens=2).status_code

    with ThreadPoolExecutor(50) as pool:
        statuses = list(pool.map(one, range(50)))
    proxy.settle()
    assert statuses == [200] * 50
    stats = mock_stats(backend)
    assert stats["chat_requests"] == 50
    assert set(stats["chat_by_slot"]) == {"0", "1"} and min(stats["chat_by_slot"].values()) >= 10
    assert stats["max_concurrent_per_slot"] == 1
    assert proxy.busy_slots() == [] and proxy.pipeline.pool.waiting == 0


def test_requests_beyond_the_wait_timeout_get_503(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=50)
    proxy = start_proxy(backend, slot_wait_timeout=0.3)

    def one(i: int) -> httpx.Response:
        return proxy.chat(user(words(i, SMALL)), max_tokens=10)   # 0.5 s each: two fit per slot at most

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(one, range(12)))
    proxy.settle()
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 503}
    busy = [r for r in responses if r.status_code == 503]
    assert all(r.json()["error"]["message"] == "all slots busy" for r in busy)
    assert proxy.busy_slots() == [] and proxy.pipeline.pool.waiting == 0


def test_meta_max_prunes_least_recently_used_with_kv_files(start_backend: Any, start_proxy: Any,
                                                           slot_dir: str) -> None:
    proxy = start_proxy(start_backend(), meta_max=2)
    for seed in (1, 2, 3):
        proxy.chat(user(words(seed, BIG)))
        proxy.settle()
    assert len(meta_files(proxy)) == 2
    assert len(os.listdir(slot_dir)) == 2
    kept = {m.removesuffix(".meta.json") for m in meta_files(proxy)}
    assert kept == set(os.listdir(slot_dir))


def test_restore_of_a_pruned_or_missing_file_falls_back_and_drops_stale_meta(proxy: Proxy, backend: Any,
                                                                             slot_dir: str) -> None:
    first = words(1, BIG)
    proxy.push(user(first))
    proxy.push(user(words(2, BIG)))
    proxy.push(user(words(3, BIG)))
    proxy.settle()
    first_key = _key_of(proxy, first)
    os.remove(os.path.join(slot_dir, first_key))
    r = proxy.chat(user(_diverging(first)))
    proxy.settle()
    assert r.status_code == 200
    assert r.headers["x-lpcache-restored"] == "false"
    assert first_key + ".meta.json" not in meta_files(proxy)
    # A file known to be gone is never asked for: the slot keeps what it holds (a failed restore would empty it).
    assert mock_stats(backend)["restore_failures"] == 0
    assert proxy.records[-1].restore_lost is True and proxy.pipeline.index.lost == 1


def test_meta_of_an_invisible_folder_is_kept(start_backend: Any, start_proxy: Any, tmp_path: Any) -> None:
    backend = start_backend()
    remote = BackendConfig(backend.url, None, str(tmp_path / "not-here"))   # a folder this host cannot see
    proxy = start_proxy(remote)
    first = words(1, BIG)
    proxy.push(user(first))
    proxy.push(user(words(2, BIG)))
    proxy.push(user(words(3, BIG)))
    proxy.settle()
    # The stand-in wrote its files elsewhere (its own folder), so the restore by name fails...
    os.remove(os.path.join(backend.app_state.config.slot_save_path, _key_of(proxy, first)))
    r = proxy.chat(user(_diverging(first)))
    proxy.settle()
    assert r.status_code == 200 and r.headers["x-lpcache-restored"] == "false"
    # ...but lpcache cannot see the folder, so it cannot tell the file is gone: the meta stays.
    assert _key_of(proxy, first) + ".meta.json" in meta_files(proxy)


def test_failed_save_is_retried(proxy: Proxy, backend: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json={"save_status": 500, "save_fail_count": 2})
    proxy.chat(user(words(1, BIG)))
    proxy.settle()
    stats = mock_stats(backend)
    assert stats["save_failures"] == 2 and stats["saves"] == 1
    assert len(meta_files(proxy)) == 1


def test_save_failing_every_retry_leaves_no_meta_and_no_file(start_backend: Any, start_proxy: Any,
                                                             slot_dir: str) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, save_retries=1)
    httpx.post(f"{backend.url}/mock/faults", json={"save_status": 500, "save_fail_count": 5})
    r = proxy.chat(user(words(1, BIG)))
    proxy.settle()
    assert r.status_code == 200
    assert mock_stats(backend)["save_failures"] == 2
    assert meta_files(proxy) == [] and os.listdir(slot_dir) == []
    assert proxy.busy_slots() == []


def test_kv_cache_false_backend_never_saves_or_restores(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    proxy = start_proxy(BackendConfig(backend.url, 2, backend.app_state.config.slot_save_path, kv_cache=False))
    first = words(1, BIG)
    for text in (first, words(2, BIG), words(3, BIG), first + " again"):
        assert proxy.chat(user(text)).status_code == 200
    proxy.settle()
    stats = mock_stats(backend)
    assert stats["saves"] == 0 and stats["restores"] == 0
    assert meta_files(proxy) == []


def test_stream_with_queue_size_one(start_backend: Any, start_proxy: Any) -> None:
    proxy = start_proxy(start_backend(), stream_queue_size=1)
    with proxy.client.stream("POST", "/v1/chat/completions",
                             json={"messages": user(words(1, SMALL)), "stream": True, "max_tokens": 50}) as r:
        raw = r.read()
    assert raw.count(b"\n\n") == 50 + 3 and raw.endswith(b"data: [DONE]\n\n")


def test_other_routes_are_forwarded_unchanged(proxy: Proxy, backend: Any) -> None:
    tok = proxy.client.post("/tokenize", json={"content": "hello world"})
    assert tok.status_code == 200 and tok.json() == httpx.post(f"{backend.url}/tokenize",
                                                               json={"content": "hello world"}).json()
    assert proxy.client.get("/props").json()["total_slots"] == 2
    assert proxy.client.get("/slots?fail_on_no_slot=1").status_code == 200
    missing = proxy.client.get("/no/such/route")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    completion = proxy.client.post("/v1/completions", json={"prompt": "once upon", "max_tokens": 3})
    assert completion.status_code == 200 and "choices" in completion.json()


def test_models_and_health(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, start_backend(model="other-model"), model_id="my-model")
    models = proxy.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["mock-model", "other-model"]   # the backends' own, merged
    assert models["data"][0]["meta"]["n_ctx"] > 0
    health = proxy.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_models_falls_back_to_model_id_when_no_backend_answers(start_proxy: Any) -> None:
    from lpcache.workloads.harness import free_port

    proxy = start_proxy(BackendConfig(f"http://127.0.0.1:{free_port()}", 1), model_id="my-model")
    assert [m["id"] for m in proxy.client.get("/v1/models").json()["data"]] == ["my-model"]


def _diverging(text: str) -> str:
    """Shares the first 150 words, then differs: its save does not supersede the original's entry."""
    return " ".join(text.split()[:150]) + " " + words(8, 60)


def _key_of(proxy: Proxy, text: str) -> str:
    """The file name of the prefix cache of a one-message prompt saved by the proxy's first backend."""
    from lpcache.cache.meta_files import prefix_file
    from lpcache.cache.prefix import Prompt

    fingerprint = proxy.pipeline.backends[0].fingerprint
    assert fingerprint is not None
    return prefix_file(Prompt.of("llama.cpp", user(text), 10).key, fingerprint)


def test_backend_api_key(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(api_key="secret")
    with_key = start_proxy(BackendConfig(backend.url, 2, backend.app_state.config.slot_save_path),
                           llama_api_key="secret")
    r = with_key.chat(user(words(1, BIG)))
    with_key.settle()
    assert r.status_code == 200
    assert mock_stats(backend)["saves"] == 1            # slot actions carry the key too
    without = start_proxy(BackendConfig(backend.url, 2, backend.app_state.config.slot_save_path))
    denied = without.chat(user(words(1, SMALL)))
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    passed = without.client.post("/v1/chat/completions", json={"messages": user(words(1, SMALL))},
                                 headers={"Authorization": "Bearer secret"})
    assert passed.status_code == 200                    # the client's own key goes through


def test_client_leaving_while_a_json_answer_is_generated(start_backend: Any, start_proxy: Any) -> None:
    import socket
    import time

    backend = start_backend(slots=1, gen_ms_per_token=20)
    proxy = start_proxy(backend)
    payload = json.dumps({"messages": user(words(1, BIG)), "max_tokens": 2000}).encode()
    sock = socket.create_connection(("127.0.0.1", proxy.server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    deadline = time.monotonic() + 10

    def decoded() -> int:
        slot = httpx.get(f"{backend.url}/slots").json()[0]
        return int(slot["next_token"][0]["n_decoded"]) if slot["is_processing"] else 0

    while decoded() < 1:     # wait until the backend is generating: its prompt was read to its end
        assert time.monotonic() < deadline
    sock.close()
    proxy.wait_finished(1)
    record = proxy.records[0]
    assert record.reason == "client_disconnected" and record.saved is True
    assert proxy.busy_slots() == []
    assert len(meta_files(proxy)) == 1


def test_a_stream_broken_by_the_backend_ends_with_an_error_event(proxy: Proxy, backend: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json={"stream_break_after": 3, "stream_break_count": 1})
    with proxy.client.stream("POST", "/v1/chat/completions",
                             json={"messages": user(words(1, SMALL)), "stream": True, "max_tokens": 20}) as r:
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) == 4 and b"[DONE]" not in raw
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["type"] == "backend_unreachable" and error["message"]
    proxy.wait_finished(1)
    assert proxy.records[0].reason == "backend_unreachable"
    assert proxy.busy_slots() == []


@pytest.mark.parametrize(("prefill_ms_per_token", "waits"), [(5.0, True), (0.01, False)])
def test_next_turn_waits_for_its_own_slot_only_when_that_beats_the_prefill(
        start_backend: Any, start_proxy: Any, prefill_ms_per_token: float, waits: bool) -> None:
    """The previous turn is still being saved (300 ms saves): the next turn waits for that slot, which holds the
    conversation, when prefilling the conversation elsewhere would take longer (5 ms a token: about 1.3 s), and takes
    the idle slot when the prefill is quicker than the wait (0.01 ms a token)."""
    backend = start_backend(prefill_ms_per_token=prefill_ms_per_token)
    proxy = start_proxy(backend)
    httpx.post(f"{backend.url}/mock/faults", json={"latency_ms": 300, "paths": ["/slots/0", "/slots/1"]})
    first = words(1, BIG)
    r1 = proxy.chat(user(first))
    r2 = proxy.chat(user(first + " and the next turn"))    # sent while the first turn's save takes 300 ms
    assert (r2.headers["x-lpcache-slot"] == r1.headers["x-lpcache-slot"]) is waits
    assert r2.headers["x-lpcache-restored"] == "false"
    assert (r2.json()["timings"]["cache_n"] > BIG) is waits
    proxy.wait_finished(2)
    assert mock_stats(backend)["restores"] == 0


def test_a_restore_the_server_does_not_reuse_stops_restores_for_that_model(
        start_backend: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A sliding-window model without --swa-full (the stand-in's swa mode): the first useless restore is
    detected, the warning names --swa-full, and lpcache neither restores nor saves for that model again."""
    backend = start_backend(swa=True, slots=1, prefill_ms_per_token=1.0)   # a prefill that a restore beats
    proxy = start_proxy(backend)
    texts = [words(i, BIG) for i in range(1, 4)]
    for text in texts:
        proxy.push(user(text))
    for text in texts[:2]:                        # two exact restores fall short: not conclusive yet
        r = proxy.push(user(text + " again"))
        assert r.headers["x-lpcache-restored"] == "true" and r.json()["timings"]["cache_n"] == 0
        assert proxy.records[-1].restore_reused is False and "restore_not_reused" not in caplog.text
    r = proxy.push(user(texts[2] + " again"))       # the third distinct file: the verdict
    assert r.headers["x-lpcache-restored"] == "true"
    assert "--swa-full" in caplog.text and "restore_not_reused" in caplog.text
    saves, restores = mock_stats(backend)["saves"], mock_stats(backend)["restores"]
    for text in (words(4, BIG), words(5, BIG), texts[0] + " and again"):
        assert proxy.push(user(text)).headers["x-lpcache-restored"] == "false"
    stats = mock_stats(backend)
    assert stats["restores"] == restores == 3 and stats["saves"] == saves
    assert "lpcache_restores_not_reused_total 3.0" in proxy.client.get("/metrics").text
    assert "lpcache_reuse_verdicts_total 1.0" in proxy.client.get("/metrics").text


def test_a_reused_restore_is_not_flagged(proxy: Proxy, backend: Any) -> None:
    first = words(1, BIG)
    for text in (first, words(2, BIG), words(3, BIG), first + " again"):
        proxy.push(user(text))
    proxy.wait_finished(4)
    assert proxy.records[3].restored is True and proxy.records[3].restore_reused is True
    assert proxy.pipeline.reuse.turned_off == 0


@pytest.mark.parametrize("session", [None, "5" * 32])
def test_a_restarted_server_is_noticed_and_the_cache_restored(start_proxy: Any, start_backend: Any, slot_dir: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              session: str | None) -> None:
    import lpcache.backends.slot_truth

    monkeypatch.setattr(lpcache.backends.slot_truth, "SLOTS_TRUSTED_FOR", 0.0)   # check before every request
    backend = start_backend(slots=1)
    proxy = start_proxy(backend)
    headers = {"X-Session-ID": session} if session else None
    first = words(1, BIG)
    proxy.push(user(first), headers)
    port = backend.app_state.config.port or int(backend.url.rsplit(":", 1)[1])
    backend.stop()
    restarted = start_backend(slots=1, port=port)      # the same server, empty, its slot files still on disk
    r = proxy.push(user(first + " after the restart"), headers)
    assert r.status_code == 200
    assert r.headers["x-lpcache-restored"] == "true"
    assert r.json()["timings"]["cache_n"] >= BIG
    assert mock_stats(restarted)["restores"] == 1
    # And without a restart the check finds the slot full: no restore, the resident cache is used.
    r = proxy.push(user(first + " after the restart and more"), headers)
    assert r.headers["x-lpcache-restored"] == "false" and r.json()["timings"]["cache_n"] >= BIG
