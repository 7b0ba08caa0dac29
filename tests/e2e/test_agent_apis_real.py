"""Every generation API an agent speaks, through lpcache in front of the real llama-server (b11434, SmolLM2, one
slot, no RAM cache: a second conversation pushes the first out, only lpcache's file brings it back).

Clients are the official SDKs (`openai` for Responses, `anthropic` for Messages) and plain HTTP for completions and
infill. For each API: a conversation's next turn after another conversation used the slot is restored (the server
reports most of the prompt as cached) and its prompt is the one llama-server renders itself (the same token count);
answers equal llama-server's own answers to the same requests at temperature 0; errors come in the API's shape.

Equality is checked with the prompt computed whole on both sides (`cache_prompt: false`): llama.cpp's arithmetic
depends on how a prompt is cut into batches, so a prompt computed on top of a cache (by lpcache's restore, or by
llama-server's own reuse of a slot) may, rarely, give a tiny model another greedy token than the prompt computed
whole; that is llama-server's behaviour with or without lpcache, not a difference in the request.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads import chats
from lpcache.workloads.harness import LlamaServer, fim_model_path

from ..agent_loop import AgentLoop
from ..conftest import Proxy, figures

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with LlamaServer(str(tmp_path_factory.mktemp("slots")), n_slots=1, cache_ram=0) as server:
        yield server


@pytest.fixture()
def proxy(one_slot: LlamaServer, tmp_path: Path) -> Iterator[Proxy]:
    p = Proxy(Settings(backends=(BackendConfig(one_slot.url, None, one_slot.slot_save_path),),
                       meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=200))
    try:
        yield p
    finally:
        p.stop()


def sse(url: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """A stream's events as (event name, data)."""
    out: list[tuple[str, Any]] = []
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def without_ids(doc: Any) -> Any:
    """A document with its generated ids and times left out (they differ on every call)."""
    if isinstance(doc, dict):
        return {k: without_ids(v) for k, v in doc.items()
                if k not in ("id", "item_id", "created_at", "completed_at", "created", "timings")}
    if isinstance(doc, list):
        return [without_ids(v) for v in doc]
    return doc


def added_out(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """A Responses event of lpcache's without the indexes it adds where the server sent none (`responses_stream`)."""
    doc = {k: v for k, v in ours.items() if k in theirs or k not in ("sequence_number", "output_index",
                                                                        "content_index")}
    response, their_response = doc.get("response"), theirs.get("response")
    if isinstance(response, dict) and isinstance(their_response, dict) and "output" not in their_response:
        doc["response"] = {k: v for k, v in response.items() if k != "output"}
    return doc


def last(proxy: Proxy) -> Any:
    """The record of the request just answered (each test sends one request at a time through lpcache, and waits
    for its record, saves included, before the next)."""
    proxy.sent = getattr(proxy, "sent", 0) + 1   # type: ignore[attr-defined]
    proxy.wait_finished(proxy.sent, timeout=300)  # type: ignore[attr-defined]
    return proxy.records[proxy.sent - 1]  # type: ignore[attr-defined]


def test_responses_with_the_openai_sdk_restore_and_equal_the_servers_answers(one_slot: LlamaServer,
                                                                              proxy: Proxy) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", timeout=300)
    direct = openai.OpenAI(base_url=one_slot.url + "/v1", api_key="none", timeout=300)
    a, b = AgentLoop(1), AgentLoop(2)
    held: dict[int, int] = {}   # each session's prompt size at its last turn
    for turn in range(3):
        for loop in (a, b):
            raw = client.responses.with_raw_response.create(**loop.responses_body())
            answer = raw.parse()
            record = last(proxy)
            assert record.api == "responses" and record.status == 200
            cached = answer.usage.input_tokens_details.cached_tokens
            figures(f"  responses turn {turn}: restored={raw.headers['x-lpcache-restored']} "
                    f"input={answer.usage.input_tokens} cached={cached}")
            if turn > 0:   # the other session used the only slot in between: the file brought this one back
                assert raw.headers["x-lpcache-restored"] == "true"
                assert cached >= 0.9 * held[id(loop)]
            held[id(loop)] = answer.usage.input_tokens
            own = direct.responses.create(**loop.responses_body())
            assert answer.usage.input_tokens == own.usage.input_tokens
            loop.advance()
    # a stream, through the SDK's stream helper, which builds the response from the events' indexes (it fails on
    # llama-server's own events, which have none: lpcache adds them, `responses_stream`)
    with client.responses.stream(**a.responses_body()) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    record = last(proxy)
    assert kinds[-1] == "response.completed" and record.restored
    assert record.cache_n is not None and record.cache_n >= 0.9 * held[id(a)]
    own = direct.responses.create(**a.responses_body())
    assert final.usage is not None and own.usage is not None and final.usage.input_tokens == own.usage.input_tokens
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in own.output]


def test_messages_with_the_anthropic_sdk_restore_and_equal_the_servers_answers(one_slot: LlamaServer,
                                                                                proxy: Proxy) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="none", timeout=300)
    direct = anthropic.Anthropic(base_url=one_slot.url, api_key="none", timeout=300)
    a, b = AgentLoop(3), AgentLoop(4)
    held: dict[int, int] = {}
    for turn in range(3):
        for loop in (a, b):
            raw = client.messages.with_raw_response.create(**loop.messages_body())
            answer = raw.parse()
            record = last(proxy)
            assert record.api == "messages" and record.status == 200
            figures(f"  messages turn {turn}: restored={raw.headers['x-lpcache-restored']} "
                    f"input={answer.usage.input_tokens} cache_read={answer.usage.cache_read_input_tokens}")
            total = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
            if turn > 0:
                assert raw.headers["x-lpcache-restored"] == "true"
                assert (answer.usage.cache_read_input_tokens or 0) >= 0.9 * held[id(loop)]
            held[id(loop)] = total
            own = direct.messages.create(**loop.messages_body())
            assert total == own.usage.input_tokens + (own.usage.cache_read_input_tokens or 0)
            loop.advance()
    with client.messages.stream(**a.messages_body()) as stream:
        final = stream.get_final_message()
    record = last(proxy)
    assert record.restored and record.api == "messages"
    own = direct.messages.create(**a.messages_body())
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        own.usage.input_tokens + (own.usage.cache_read_input_tokens or 0)


@pytest.fixture()
def whole(one_slot: LlamaServer, tmp_path: Path) -> Iterator[Proxy]:
    """lpcache that never asks for the cache (no request is big): the client's `cache_prompt: false` holds."""
    p = Proxy(Settings(backends=(BackendConfig(one_slot.url, None, one_slot.slot_save_path),),
                       meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=10**9))
    try:
        yield p
    finally:
        p.stop()


WHOLE = {"cache_prompt": False}


def test_responses_answers_equal_the_servers_own(one_slot: LlamaServer, whole: Proxy) -> None:
    client = openai.OpenAI(base_url=whole.url + "/v1", api_key="none", timeout=300)
    direct = openai.OpenAI(base_url=one_slot.url + "/v1", api_key="none", timeout=300)
    loop = AgentLoop(5)
    for _turn in range(3):
        body = loop.responses_body()
        mine, own = (c.responses.create(**body, extra_body=WHOLE) for c in (client, direct))
        assert mine.output == own.output or [o.model_dump(exclude={"id"}) for o in mine.output] == [
            o.model_dump(exclude={"id"}) for o in own.output]
        assert mine.usage == own.usage and mine.status == own.status
        events = sse(whole.url + "/v1/responses", {**body, **WHOLE, "stream": True})
        own_events = sse(one_slot.url + "/v1/responses", {**body, **WHOLE, "stream": True})
        assert [name for name, _ in events] == [name for name, _ in own_events]
        assert [without_ids(added_out(doc, own)) for (_, doc), (_, own) in zip(events, own_events, strict=True)] == [
            without_ids(doc) for _, doc in own_events]
        assert all("sequence_number" in doc for _, doc in events)
        loop.advance()


def test_messages_answers_equal_the_servers_own(one_slot: LlamaServer, whole: Proxy) -> None:
    client = anthropic.Anthropic(base_url=whole.url, api_key="none", timeout=300)
    direct = anthropic.Anthropic(base_url=one_slot.url, api_key="none", timeout=300)
    loop = AgentLoop(6)
    for _turn in range(3):
        body = loop.messages_body()
        # llama-server's /v1/messages always uses its cache (its conversion drops `cache_prompt`): both sides answer
        # with the slot holding this very prompt (put there by the request before), so both compute the same part
        direct.messages.create(**body)
        mine, own = (c.messages.create(**body) for c in (client, direct))
        assert mine.model_dump(exclude={"id"}) == own.model_dump(exclude={"id"})
        with client.messages.stream(**body) as stream:
            events = [e.model_dump() for e in stream]
        with direct.messages.stream(**body) as stream:
            own_events = [e.model_dump() for e in stream]
        assert [without_ids(e) for e in events] == [without_ids(e) for e in own_events]
        loop.advance()


def test_errors_come_in_each_apis_shape(proxy: Proxy) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="none", timeout=60, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="llama.cpp", max_tokens=4, messages=[])
    body = caught.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages" in body["error"]["message"]
    r = proxy.client.post("/v1/responses", json={"model": "llama.cpp"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "input" in r.json()["error"]["message"]
    r = proxy.client.post("/v1/messages", content=b"{not json")
    assert r.status_code == 422 and r.json()["type"] == "error"


def test_completions_text_and_token_prompts_are_saved_and_restored(one_slot: LlamaServer, proxy: Proxy) -> None:
    rng = random.Random(11)
    text_a, text_b = chats.text(rng, 500), chats.text(rng, 500)
    tokens_a = httpx.post(f"{one_slot.url}/tokenize", json={"content": chats.text(rng, 500)}).json()["tokens"]
    for path, prompt, other in (("/v1/completions", text_a, text_b), ("/completion", tokens_a, text_b)):
        for body in ({"prompt": prompt}, {"prompt": other}):
            r = proxy.client.post(path, json={**body, "max_tokens": 4, "n_predict": 4, "temperature": 0},
                                  timeout=300)
            assert r.status_code == 200, r.text
            last(proxy)
        grown = prompt + " And then, one more line." if isinstance(prompt, str) else prompt + prompt[:20]
        r = proxy.client.post(path, json={"prompt": grown, "max_tokens": 4, "n_predict": 4, "temperature": 0},
                              timeout=300)
        record = last(proxy)
        timings = r.json()["timings"]
        figures(f"  {path}: restored={record.restored} cache_n={timings['cache_n']} prompt_n={timings['prompt_n']}")
        assert record.api == "completions" and record.restored and r.headers["x-lpcache-restored"] == "true"
        assert timings["cache_n"] >= 0.9 * (timings["cache_n"] + timings["prompt_n"]) - 20


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One slot, no RAM cache, a model with fill-in-the-middle tokens (`fim_model_path`)."""
    with LlamaServer(str(tmp_path_factory.mktemp("fim")), n_slots=1, cache_ram=0,
                     extra=["-m", fim_model_path()]) as server:
        yield server


def test_infill_is_saved_and_restored(fim_server: LlamaServer, tmp_path: Path) -> None:
    proxy = Proxy(Settings(backends=(BackendConfig(fim_server.url, None, fim_server.slot_save_path),),
                           meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=200))
    try:
        rng = random.Random(21)
        extra = [{"filename": f"src/{name}.py", "text": chats.text(rng, 250)} for name in ("models", "views")]
        above = "def total(items):\n    s = 0\n    for it in items:\n"
        body = {"input_extra": extra, "input_prefix": above, "input_suffix": "\n    return s\n", "n_predict": 3}
        other = {**body, "input_extra": [{"filename": "b.py", "text": chats.text(rng, 500)}]}
        for b in (body, other):
            r = proxy.client.post("/infill", json=b, timeout=300)
            assert r.status_code == 200, r.text
            assert last(proxy).saved
        typed = {**body, "input_prefix": above + "        s += it"}   # the user typed on
        r = proxy.client.post("/infill", json=typed, timeout=300)
        record = last(proxy)
        timings = r.json()["timings"]
        figures(f"  infill: restored={record.restored} cache_n={timings['cache_n']} prompt_n={timings['prompt_n']}")
        assert r.status_code == 200 and record.api == "infill" and record.restored and record.restore_reused
        assert timings["cache_n"] >= 0.9 * (timings["cache_n"] + timings["prompt_n"]) - 30
    finally:
        proxy.stop()
