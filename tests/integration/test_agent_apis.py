"""Every generation API through lpcache in front of the stand-in: Responses, Messages, completions (text and token
ids), infill. A session's next turn after another one used the only slot is restored; session mode works on every
route; the record, the request log, the metrics and /lpcache/sessions name the API; errors have the API's shape;
identical concurrent requests of an API are coalesced into one backend call; a body no adapter can key is served
uncached through a slot of the pool."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig
from lpcache.workloads import agents, chats

from ..agent_loop import AgentLoop
from .conftest import Proxy, mock_stats

PREFILL = 0.2   # ms per token: a restore pays


def post(proxy: Proxy, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    n = len(proxy.records)
    r = proxy.client.post(path, json=body, headers=headers, timeout=60)
    proxy.wait_finished(n + 1)
    return r


def record(proxy: Proxy) -> Any:
    return proxy.records[-1]


def responses_body(loop: AgentLoop) -> dict[str, Any]:
    body = loop.responses_body()
    body["max_output_tokens"] = 4
    return body


def messages_body(loop: AgentLoop) -> dict[str, Any]:
    body = loop.messages_body()
    body.update(body.pop("extra_body"), max_tokens=4)
    return body


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_an_agent_session_is_restored_turn_after_turn(start_backend: Any, start_proxy: Any, api: str) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    path, make = ("/v1/responses", responses_body) if api == "responses" else ("/v1/messages", messages_body)
    a, b = AgentLoop(1, words=60), AgentLoop(2, words=60)
    for turn in range(3):
        for loop in (a, b):
            r = post(proxy, path, make(loop))
            assert r.status_code == 200, r.text
            rec = record(proxy)
            assert rec.api == api and rec.saved
            if turn > 0:
                assert r.headers["x-lpcache-restored"] == "true" and rec.restore_exact and rec.restore_reused
            loop.advance()
    doc = r.json()
    if api == "messages":   # the chat answer turned back into a Message
        assert doc["type"] == "message" and doc["role"] == "assistant"
        assert doc["usage"]["cache_read_input_tokens"] > doc["usage"]["input_tokens"]
        assert mock_stats(backend)["requests_by_path"].get("/v1/messages") is None   # sent as a pinned chat
    else:
        assert doc["object"] == "response" and doc["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert proxy.busy_slots() == []


def test_a_messages_stream_is_anthropics_event_stream(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend)
    body = {**messages_body(AgentLoop(3, words=60)), "stream": True}
    with proxy.client.stream("POST", "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "[DONE]" not in text
    start = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])
    assert start["message"]["usage"]["input_tokens"] > 0
    proxy.wait_finished(1)
    assert record(proxy).api == "messages" and record(proxy).cache_n is not None


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
@pytest.mark.parametrize("ids", [False, True], ids=["text", "token-ids"])
def test_completions_are_saved_and_restored(start_backend: Any, start_proxy: Any, path: str, ids: bool) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    rng = random.Random(5)
    first, other = chats.text(rng, 300), chats.text(rng, 300)
    if ids:
        first, other = (httpx.post(f"{backend.url}/tokenize", json={"content": t}).json()["tokens"]
                        for t in (first, other))
    for prompt in (first, other):
        assert post(proxy, path, {"prompt": prompt, "max_tokens": 3}).status_code == 200
    grown = first + first[:10] if ids else first + "\nAnd one more line."
    r = post(proxy, path, {"prompt": grown, "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-lpcache-restored"] == "true"
    assert record(proxy).api == "completions" and record(proxy).restore_exact
    assert r.json()["timings"]["cache_n"] > 0.8 * r.json()["timings"]["prompt_n"]


def test_infill_shares_the_extra_context_and_the_code_above(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    rng = random.Random(9)
    extra = [{"filename": f"src/{n}.py", "text": chats.text(rng, 150)} for n in ("models", "views")]
    above = "def total(items):\n    s = 0\n    for it in items:\n"
    body = {"input_extra": extra, "input_prefix": above, "input_suffix": "\n    return s\n", "n_predict": 3}
    other = {"input_extra": [{"filename": "b.py", "text": chats.text(rng, 300)}], "input_prefix": "x = ",
             "input_suffix": "", "n_predict": 3}
    for b in (body, other):
        assert post(proxy, "/infill", b).status_code == 200
    typed = {**body, "input_prefix": above + "        s += it"}   # the user typed on
    r = post(proxy, "/infill", typed)
    assert r.status_code == 200, r.text
    assert r.headers["x-lpcache-restored"] == "true" and record(proxy).api == "infill"
    assert r.json()["timings"]["cache_n"] > 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/completions", "/infill"])
def test_session_mode_works_on_every_route(start_backend: Any, start_proxy: Any, path: str) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    rng = random.Random(len(path))
    loops = [AgentLoop(7, words=60), AgentLoop(8, words=60)]

    def body(i: int) -> dict[str, Any]:
        loop = loops[i]
        if path == "/v1/responses":
            return responses_body(loop)
        if path == "/v1/messages":
            return messages_body(loop)
        text = "\n".join(str(m.get("content")) for m in loop.items)
        if path == "/infill":
            return {"input_extra": [{"filename": "a.py", "text": text}], "input_prefix": "x",
                    "input_suffix": "", "n_predict": 2}
        return {"prompt": text, "max_tokens": 2}

    sessions = ["a" * 32, "b" * 32]
    for turn in range(2):
        for i in (0, 1):
            r = post(proxy, path, body(i), **{"X-Session-ID": sessions[i]})
            assert r.status_code == 200, r.text
            assert record(proxy).session == sessions[i]
            if turn == 1:   # the other session used the slot in between: its file came back
                assert r.headers["x-lpcache-restored"] == "true", (path, turn, i)
        for loop in loops:
            loop.advance()
            rng.random()
    listed = proxy.client.get("/lpcache/sessions").json()["data"]
    api = {"/v1/responses": "responses", "/v1/messages": "messages", "/v1/completions": "completions",
           "/infill": "infill"}[path]
    assert {s["session"] for s in listed} == set(sessions)
    assert all(s["apis"] == {api: 2} for s in listed)


def test_errors_have_the_apis_shape_and_backend_errors_pass_on(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend)
    r = post(proxy, "/v1/messages", {"model": "m", "max_tokens": 3, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "messages" in r.json()["error"]["message"]
    r = proxy.client.post("/v1/messages", content=b"[1, 2")
    assert r.status_code == 422 and r.json()["type"] == "error"
    for path, body in (("/v1/responses", {"model": "m"}), ("/v1/completions", {"max_tokens": 2}),
                       ("/infill", {"input_prefix": 5})):
        r = post(proxy, path, body)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "code"}, (path, r.text)
    # the backend's own refusal goes on as it came
    r = post(proxy, "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and "previous_response_id" in r.text
    assert proxy.busy_slots() == []


def test_identical_concurrent_requests_of_an_api_are_one_backend_call(start_backend: Any,
                                                                       start_proxy: Any) -> None:
    backend = start_backend(slots=2, gen_ms_per_token=30.0)
    proxy = start_proxy(backend, coalesce_requests=True)
    body = responses_body(AgentLoop(11, words=60))
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(
        proxy.client.post("/v1/responses", json=body, timeout=60))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proxy.wait_finished(3)
    assert [a.status_code for a in answers] == [200] * 3
    assert len({a.json()["output"][0]["content"][0]["text"] for a in answers}) == 1
    assert mock_stats(backend)["requests_by_path"]["/v1/responses"] == 1
    # a chat request with the same prompt is not given a Responses answer
    assert sum(1 for r in proxy.records if r.coalesced) == 2


def test_the_record_the_log_and_the_metrics_name_the_api(start_backend: Any, start_proxy: Any,
                                                        tmp_path: Any) -> None:
    backend = start_backend(slots=1)
    log = tmp_path / "requests.log"
    proxy = start_proxy(backend, plugins=({"name": "request_log", "params": {
        "path": str(log), "fields": ["cs-uri", "sc-status", "lpcache-api"]}},))
    post(proxy, "/v1/responses", responses_body(AgentLoop(12, words=30)))
    post(proxy, "/v1/messages", messages_body(AgentLoop(13, words=30)))
    metrics = proxy.client.get("/metrics").text
    assert 'route="/v1/responses"' in metrics and 'route="/v1/messages"' in metrics
    lines = log.read_text().splitlines()
    fields = next(line for line in lines if line.startswith("#Fields:")).split()[1:]
    rows = [dict(zip(fields, line.split(), strict=False)) for line in lines if not line.startswith("#")]
    assert [row["lpcache-api"] for row in rows] == ["responses", "messages"]


def test_a_body_no_adapter_can_key_is_served_uncached(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(BackendConfig(backend.url, None, backend.app_state.config.slot_save_path))
    r = post(proxy, "/v1/completions", {"prompt": ["one prompt", "another prompt"], "max_tokens": 2})
    assert r.status_code == 200
    assert record(proxy).api == "completions" and record(proxy).key is None
    assert proxy.pipeline.pool.slots[0].content is None and proxy.busy_slots() == []


KEYWORD = ({"name": "keyword", "params": {"keywords": ["forbidden-word"]}},)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a forbidden-word here"}], "n": 2}),
    ("/v1/completions", {"prompt": ["fine", "a forbidden-word here"]}),
    ("/v1/responses", {"input": "a forbidden-word here", "previous_response_id": "resp_1"}),
    ("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "run",
                                           "input": {"cmd": "echo forbidden-word"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}),
    ("/infill", {"input_prefix": "x = 1\n" * 400 + "# forbidden-word", "input_suffix": ""}),
])
def test_prefilters_read_every_apis_text_cached_or_not(start_backend: Any, start_proxy: Any, path: str,
                                                       body: dict[str, Any]) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend, plugins=KEYWORD)
    r = post(proxy, path, body)
    assert r.status_code == 400, (path, r.text)
    assert mock_stats(backend)["chat_requests"] == 0 and proxy.busy_slots() == []


def test_uncached_requests_keep_lpcaches_key_to_themselves(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, api_key="server-key")
    proxy = start_proxy(backend, api_keys=("client-key",))
    for body in ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, {"prompt": ["a", "b"]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = proxy.client.post(path, json=body, headers={"Authorization": "Bearer client-key"})
        assert r.status_code == 401, r.text   # the server's own refusal: lpcache's key never went on to it


def test_a_deeply_nested_uncached_body_is_a_400(start_backend: Any, start_proxy: Any) -> None:
    proxy = start_proxy(start_backend(slots=1))
    nested: Any = "x"
    for _ in range(300):
        nested = {"a": nested}
    r = post(proxy, "/v1/completions", {"prompt": nested})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body"
    assert proxy.busy_slots() == []


def test_lpcaches_own_refusals_on_messages_have_anthropics_shape(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, gen_ms_per_token=50.0)
    proxy = start_proxy(backend, api_keys=("k1",))
    r = proxy.client.post("/v1/messages", json=messages_body(AgentLoop(14, words=20)))
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    r = proxy.client.post("/v1/responses", json={"input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("keys_held", [True, False])
def test_an_anthropic_clients_x_api_key_is_its_key(start_backend: Any, start_proxy: Any, keys_held: bool) -> None:
    """Anthropic's SDKs send their key as X-Api-Key. With client keys, lpcache takes it as the client's key (and
    keeps it); without, it goes on to llama-server, which reads it after Authorization (its --api-key)."""
    backend = start_backend(slots=1, api_key=None if keys_held else "server-key")
    proxy = start_proxy(backend, **({"api_keys": ("k1",)} if keys_held else {}))
    good, bad = ("k1", "k2") if keys_held else ("server-key", "wrong")
    body = messages_body(AgentLoop(15, words=20))
    r = proxy.client.post("/v1/messages", json=body, headers={"X-Api-Key": good})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = proxy.client.post("/v1/messages", json=body, headers={"X-Api-Key": bad})
    assert r.status_code == 401
    if keys_held:   # lpcache's refusal, in Anthropic's shape; the server never saw the request
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
        assert mock_stats(backend)["requests_by_path"].get("/v1/chat/completions") == 1
    # the sessions of a key shown in X-Api-Key are its own, as with Authorization: Bearer
    if keys_held:
        sid = "7" * 32
        r = proxy.client.post("/v1/messages", json=body, headers={"X-Api-Key": good, "X-Session-ID": sid})
        assert r.status_code == 200
        listed = proxy.client.get("/lpcache/sessions", headers={"Authorization": "Bearer k1"}).json()
        assert sid in json.dumps(listed)


def test_coalesced_messages_followers_get_the_leaders_error(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, gen_ms_per_token=200.0)
    proxy = start_proxy(backend, coalesce_requests=True, slot_wait_timeout=1.0)
    holder = threading.Thread(target=lambda: proxy.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hold the slot"}], "max_tokens": 40},
        timeout=60))
    holder.start()
    body = messages_body(AgentLoop(15, words=20))
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def send() -> None:
        r = httpx.post(proxy.url + "/v1/messages", json=body, timeout=60)
        with lock:
            answers.append(r)

    deadline = time.monotonic() + 30
    while not proxy.busy_slots():   # until the holder has the only slot (polled: no event tells it)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    holder.join()
    assert [a.status_code for a in answers] == [503] * 3
    assert all(a.json()["type"] == "error" and a.json()["error"]["type"] == "unavailable_error" for a in answers)


def test_coalesced_messages_streams_that_break_end_alike(start_backend: Any, start_proxy: Any) -> None:
    """A shared Messages stream that the backend cuts halfway: the followers get the very bytes the leader's client
    got, Anthropic's `event: error` at the end included (not an OpenAI error chunk)."""
    backend = start_backend(slots=1, gen_ms_per_token=30.0)
    proxy = start_proxy(backend, coalesce_requests=True)
    httpx.post(f"{backend.url}/mock/faults", json={"stream_break_after": 4, "stream_break_count": 1})
    body = messages_body(AgentLoop(16, words=60)) | {"stream": True, "max_tokens": 20}
    bodies: list[bytes] = []
    lock = threading.Lock()

    def send() -> None:
        with httpx.stream("POST", proxy.url + "/v1/messages", json=body, timeout=60) as r:
            assert r.status_code == 200
            raw = r.read()
        with lock:
            bodies.append(raw)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proxy.wait_finished(3)
    assert sum(1 for r in proxy.records if r.coalesced) == 2, "the three did not share one call"
    assert len(set(bodies)) == 1
    last = bodies[0].rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"event: error\ndata: ")   # as llama-server's own /v1/messages ends a broken stream
    assert json.loads(last.split(b"data: ", 1)[1])["type"] == "backend_unreachable"
    assert b'"choices"' not in bodies[0] and b"event: content_block_delta" in bodies[0]


@pytest.mark.parametrize(("api", "servers", "learnt", "stream", "waits", "max_tokens"), [
    ("responses", 1, False, True, True, 4), ("messages", 1, False, True, True, 4),
    ("messages", 1, True, False, True, 4), ("messages", 1, False, False, True, 4),
    ("messages", 1, False, False, False, 4096), ("messages", 2, False, True, False, 4)])
def test_a_session_starting_beside_another_on_one_server_waits_for_its_harness(
        start_backend: Any, start_proxy: Any, api: str, servers: int, learnt: bool, stream: bool,
        waits: bool, max_tokens: int) -> None:
    """Two agent sessions of one harness (system prompt and tool schemas) start together. On one server (-np 2) the
    second waits for the first's slot and computes only its own task: a prefill beside the first would share that
    server's compute and compute the harness twice. A streamed first request is waited out to its first token,
    then for as long as the harness's prefill (measured on it) would take; a JSON one at learnt speeds (`learnt`:
    a request before them taught lpcache the server's speeds), or before them when its `max_tokens` makes its answer
    surely shorter to generate than the harness is to prefill (not with a 4096-token cap). With an idle slot on
    another server the second goes there at once."""
    speed = {"prefill_ms_per_token": 1.0, "gen_ms_per_token": 1.0}
    backends = ([start_backend(slots=2, **speed)] if servers == 1 else
                [start_backend(slots=1, **speed) for _ in range(2)])
    proxy = start_proxy(*backends)
    if learnt:
        rng = random.Random(5)
        r = post(proxy, "/v1/chat/completions", {"messages": [{"role": "user", "content": " ".join(
            chats.sentence(rng) for _ in range(80))}], "max_tokens": 40})
        speeds = proxy.pipeline.speeds.of(0, "").describe()
        assert r.status_code == 200 and speeds["prefill_ms_per_token"] and speeds["generate_ms_per_token"]
        proxy.records.clear()
    first, second = [s for s in agents.sessions(4) if s.api == api]
    answers: list[httpx.Response] = []

    def send(session: agents.Session) -> None:
        answers.append(proxy.client.post(agents.API_PATHS[api], json=session.body(0, max_tokens=max_tokens,
                                                                                   stream=stream), timeout=60))

    known = sum(mock_stats(b)["chat_requests"] for b in backends)
    leader = threading.Thread(target=send, args=(first,))
    leader.start()
    deadline = time.monotonic() + 30
    while sum(mock_stats(b)["chat_requests"] for b in backends) <= known:   # the first is prefilling on its server
        assert time.monotonic() < deadline
    send(second)
    leader.join()
    proxy.wait_finished(2)
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    a, b = proxy.records
    assert a.cache_n == 0 and a.prompt_n and a.prompt_n > 2000 and not b.restored
    if waits:
        assert (b.backend, b.slot) == (a.backend, a.slot)
        assert b.cache_n and b.cache_n > 2000 and b.prompt_n and b.prompt_n < a.prompt_n - 2000
    else:
        assert (b.backend, b.slot) != (a.backend, a.slot) and b.cache_n == 0
        assert (b.backend != a.backend) is (servers == 2)
