"""The stand-in's agent routes: OpenAI Responses, Anthropic Messages, /infill, and completions given token ids.

Each answers in the real server's shape, runs on the slots and prompt cache like a chat request (a Responses
request may pin its slot, an Anthropic one may not), and counts `cache_n` as the reused prefix, `prompt_n` as the
rest. tests/e2e/test_mock_routes_real.py checks the same shapes against llama-server b11434.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from lpcache.mock_llama.agent_routes import FIM_MID, FIM_PRE, FIM_REP, FIM_SEP, FIM_SUF, NO_FIM
from lpcache.mock_llama.tokens import render_chat, tokenize

from .conftest import MakeMock

SYSTEM = "You answer questions about caches."
QUESTION = "Why does a shared prefix make the second request cheaper?"
RESPONSES_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
]
ANTHROPIC_EVENTS = [
    "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
    "content_block_stop", "message_delta", "message_stop",
]


@pytest.fixture
async def client(make_mock: MakeMock) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=make_mock().url, timeout=10) as c:
        yield c


def prompt_len(messages: list[dict[str, Any]]) -> int:
    return len(tokenize(render_chat(messages)))


async def by_slot(c: httpx.AsyncClient) -> dict[str, int]:
    return (await c.get("/mock/stats")).json()["chat_by_slot"]  # type: ignore[no-any-return]


async def wait_idle(c: httpx.AsyncClient) -> None:
    """Until every slot is given back: a stream's slot is freed just after its last byte left."""
    assert (await c.get("/mock/wait-idle", params={"timeout": "5"})).json() == {"idle": True}


async def named_events(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A stream's `event:`/`data:` pairs; fails on any other line (a `[DONE]`, an unnamed event)."""
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.aread()).decode()
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: "):], orjson.loads(data[len("data: "):])))
    assert raw.endswith("\n\n")
    return events


# --- OpenAI Responses --------------------------------------------------------------------------------------------


async def test_responses_json_answer(client: httpx.AsyncClient) -> None:
    body = {"model": "x", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 5}
    for path in ("/v1/responses", "/responses"):
        r = await client.post(path, json=body)
        assert r.status_code == 200
        answer = r.json()
        assert list(answer) == ["completed_at", "created_at", "id", "model", "object", "output", "status", "usage"]
        assert answer["id"].startswith("resp_") and (answer["object"], answer["status"]) == ("response", "completed")
        assert answer["model"] == "test-model"
        [message] = answer["output"]
        assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
        [part] = message["content"]
        assert part["type"] == "output_text" and len(part["text"].split()) == 5
    n = prompt_len([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    # The second request is the same prompt: all but its last token come from the slot.
    assert answer["usage"] == {"input_tokens": n, "output_tokens": 5, "total_tokens": n + 5,
                               "input_tokens_details": {"cached_tokens": n - 1}}


async def test_responses_pin_their_slot_and_reuse_the_shared_prefix(client: httpx.AsyncClient) -> None:
    first_input = [{"role": "user", "content": QUESTION}]
    first = (await client.post("/v1/responses", json={"input": first_input, "id_slot": 1, "max_output_tokens": 4}))
    reply = first.json()["output"][0]["content"][0]["text"]
    follow_up = [*first_input,
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": reply}]},
                 {"role": "user", "content": [{"type": "input_text", "text": "And the third?"}]}]
    second = (await client.post("/v1/responses", json={"input": follow_up, "id_slot": 1, "max_output_tokens": 4}))
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the third?"}]
    usage = second.json()["usage"]
    # The slot held the first prompt and 3 of its 4 answer tokens (the last one is never decoded).
    assert usage["input_tokens_details"]["cached_tokens"] == prompt_len(chat[:1]) + 3
    assert usage["input_tokens"] == prompt_len(chat)
    assert await by_slot(client) == {"1": 2}


async def test_responses_stream_events_in_order(client: httpx.AsyncClient) -> None:
    body = {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 3, "id_slot": 0}
    events = await named_events(client, "/v1/responses", body)
    assert [name for name, _ in events] == RESPONSES_EVENTS
    assert all(data["type"] == name for name, data in events)
    item_ids = {data["item_id"] for _, data in events if "item_id" in data}
    assert len(item_ids) == 1 and item_ids.pop().startswith("msg_")
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    done = events[-1][1]
    assert done["response"]["output"][0]["content"][0]["text"] == text == events[7][1]["text"]
    assert done["response"]["id"] == events[0][1]["response"]["id"]
    usage, timings = done["response"]["usage"], done["timings"]
    assert (usage["output_tokens"], timings["predicted_n"]) == (3, 3)
    assert usage["input_tokens_details"]["cached_tokens"] == timings["cache_n"] == 0
    assert usage["input_tokens"] == timings["prompt_n"] + timings["cache_n"]
    again = (await named_events(client, "/v1/responses", body))[-1][1]
    assert again["timings"]["cache_n"] == again["response"]["usage"]["input_tokens"] - 1
    assert all("timings" not in data for _, data in events[:-1])


async def test_responses_render_like_the_chat_they_convert_to(client: httpx.AsyncClient) -> None:
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    chat = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ], "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                   "strict": True}}]}
    counted = (await client.post("/v1/responses/input_tokens", json={"input": items, "tools": tools})).json()
    expected = (await client.post("/v1/chat/completions/input_tokens", json=chat)).json()
    assert counted == expected == {"input_tokens": len(tokenize(render_chat(chat["messages"], chat["tools"]))),
                                   "object": "response.input_tokens"}
    answer = (await client.post("/responses", json={"input": items, "tools": tools, "max_output_tokens": 2})).json()
    assert answer["usage"]["input_tokens"] == counted["input_tokens"]
    refused = await client.post("/v1/responses", json={"input": [{"type": "mystery"}]})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "Cannot determine type of 'item'"


# --- Anthropic Messages ------------------------------------------------------------------------------------------


async def test_anthropic_json_answer_and_the_slot_chosen_despite_id_slot(client: httpx.AsyncClient) -> None:
    body = {"model": "x", "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4,
            "id_slot": 1}
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200
    answer = r.json()
    assert list(answer) == ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"]
    assert answer["id"].startswith("chatcmpl-") and (answer["type"], answer["role"]) == ("message", "assistant")
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("max_tokens", None)
    [block] = answer["content"]
    assert block["type"] == "text" and len(block["text"].split()) == 4
    n = prompt_len([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert answer["usage"] == {"cache_read_input_tokens": 0, "input_tokens": n, "output_tokens": 4}
    assert "timings" not in answer
    # id_slot was dropped: the idle slot used least recently (the lowest id on a tie) served it, not slot 1.
    assert await by_slot(client) == {"0": 1}

    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": block["text"]}, {"role": "user", "content": "More?"}]
    follow_up = {"system": SYSTEM, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": block["text"]}]},
        {"role": "user", "content": "More?"}]}
    usage = (await client.post("/v1/messages", json=follow_up)).json()["usage"]
    # Unpinned, it goes where its prefix is; the prompt splits into the part read from the cache and the rest.
    assert usage["cache_read_input_tokens"] == n + 3
    assert usage["input_tokens"] == prompt_len(chat) - (n + 3)
    assert await by_slot(client) == {"0": 2}
    counted = (await client.post("/v1/messages/count_tokens", json=follow_up)).json()
    assert counted == {"input_tokens": prompt_len(chat)}


async def test_anthropic_without_max_tokens_generates_up_to_4096(make_mock: MakeMock) -> None:
    mock = make_mock(n_ctx=64)
    messages = [{"role": "user", "content": QUESTION}]
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        answer = (await c.post("/v1/messages", json={"messages": messages, "n_predict": 2})).json()
        missing = await c.post("/v1/messages", json={"system": "s"})
    # Not the stand-in's default answer length, and n_predict was dropped: the context's end stops it.
    assert answer["usage"]["output_tokens"] == 64 - prompt_len(messages)
    assert missing.status_code == 500 and missing.json()["error"]["message"] == "'messages' is required"


async def test_anthropic_stream_events_in_order(client: httpx.AsyncClient) -> None:
    body = {"system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 3}
    events = await named_events(client, "/v1/messages", body)
    assert [name for name, _ in events] == ANTHROPIC_EVENTS
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    n = prompt_len([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert start["usage"] == {"cache_read_input_tokens": 0, "input_tokens": n, "output_tokens": 0}
    assert (start["content"], start["stop_reason"]) == ([], None)
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas) and len("".join(d["text"] for d in deltas).split()) == 3
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                             "usage": {"output_tokens": 3}}
    await wait_idle(client)  # else the slot holding the prefix may still be busy, and the other one is chosen
    again = (await named_events(client, "/v1/messages", body))[0][1]["message"]["usage"]
    assert (again["cache_read_input_tokens"], again["input_tokens"]) == (n - 1, 1)


# --- /infill -----------------------------------------------------------------------------------------------------

EXTRA = [{"filename": "util.py", "text": "def helper(x):\n    return x * 2\n"}, {"text": "CONSTANT = 7\n"}]
PREFIX = "def total(values):\n    result = 0\n    for v in values:\n"
SUFFIX = "\n    return result\n"


def infill_tokens(prefix: str, prompt: str, suffix: str) -> list[str]:
    extra = [FIM_REP, "myproject", FIM_SEP, *tokenize("util.py"), *tokenize(EXTRA[0]["text"]),
             FIM_SEP, "tmp", *tokenize(EXTRA[1]["text"]), FIM_SEP, "filename"]
    return [*extra, FIM_PRE, *tokenize(prefix), *tokenize(prompt), FIM_SUF, *tokenize(suffix), FIM_MID]


async def test_infill_builds_the_real_prompt_and_reuses_extra_and_prefix(client: httpx.AsyncClient) -> None:
    body = {"input_extra": EXTRA, "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "        result",
            "n_predict": 3, "id_slot": 1}
    first = (await client.post("/infill", json=body)).json()
    expected = infill_tokens(PREFIX, "        result", SUFFIX)
    assert first["prompt"] == " ".join(expected)
    assert (first["id_slot"], first["tokens_evaluated"], first["tokens_cached"]) == (1, len(expected),
                                                                                     len(expected) + 2)
    assert (first["stop"], first["stop_type"], first["model"]) == (True, "limit", "test-model")
    assert len(first["content"].split()) == 3 and first["timings"]["prompt_n"] == len(expected)

    other = {**body, "prompt": "        total += v", "input_suffix": "\n    print(result)\n"}
    second = (await client.post("/infill", json=other)).json()
    shared = len(infill_tokens(PREFIX, "", "")) - 2  # everything before the prompt: extra, FIM prefix, prefix
    assert second["timings"]["cache_n"] == shared
    assert second["timings"]["prompt_n"] == len(infill_tokens(PREFIX, "        total += v", other["input_suffix"])) \
        - shared
    assert await by_slot(client) == {"1": 2}

    async with client.stream("POST", "/infill", json={**body, "stream": True, "id_slot": 0}) as r:
        lines = [orjson.loads(line[len("data: "):]) async for line in r.aiter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in lines] == [False, False, False, True] and lines[-1]["id_slot"] == 0


async def test_infill_errors(make_mock: MakeMock) -> None:
    fim, no_fim = make_mock(), make_mock(fim=False)
    body = {"input_prefix": "a", "input_suffix": "b"}
    async with httpx.AsyncClient(timeout=10) as c:
        unsupported = await c.post(f"{no_fim.url}/infill", json=body)
        refused = [await c.post(f"{fim.url}/infill", json=b) for b in (
            {"input_suffix": "b"}, {"input_prefix": "a"}, {**body, "prompt": 3}, {**body, "input_extra": {}},
            {**body, "input_extra": [{"filename": "f"}]}, {**body, "input_extra": [{"text": "t", "filename": 1}]})]
    assert unsupported.status_code == 501
    assert unsupported.json() == {"error": {"code": 501, "message": NO_FIM, "type": "not_supported_error"}}
    assert [r.status_code for r in refused] == [400] * 6
    assert refused[0].json()["error"]["message"] == '"input_prefix" is required'


# --- completions given token ids ---------------------------------------------------------------------------------


async def test_completions_take_token_ids_and_honour_id_slot(client: httpx.AsyncClient) -> None:
    text = "the cache keeps every token it has computed"
    ids = (await client.post("/tokenize", json={"content": text})).json()["tokens"]
    first = (await client.post("/completion", json={"prompt": ids, "n_predict": 2, "id_slot": 1})).json()
    assert first["id_slot"] == 1 and first["tokens_evaluated"] == len(ids) and first["prompt"] == text
    nested = (await client.post("/completion", json={"prompt": [ids], "n_predict": 2, "id_slot": 1})).json()
    assert nested["timings"]["cache_n"] == len(ids) - 1 and nested["content"] == first["content"]
    mixed = (await client.post("/completions", json={"prompt": ["the cache keeps", *ids[3:], "and more"],
                                                     "n_predict": 2, "id_slot": 1})).json()
    assert mixed["timings"]["cache_n"] == len(ids) and mixed["tokens_evaluated"] == len(ids) + 2
    oai = (await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "id_slot": 0})).json()
    assert oai["usage"]["prompt_tokens"] == len(ids) and oai["timings"]["cache_n"] == 0
    assert await by_slot(client) == {"0": 1, "1": 3}
    unknown = await client.post("/completion", json={"prompt": [ids[0], 7]})
    assert unknown.status_code == 400


# --- router mode -------------------------------------------------------------------------------------------------


async def test_agent_routes_go_through_the_router(make_mock: MakeMock, tmp_path: Path) -> None:
    router = make_mock(router=True, models=("a", "b"))
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
        answers = [
            await c.post("/v1/responses", json={"model": "a", "input": QUESTION, "max_output_tokens": 2}),
            await c.post("/v1/messages", json={"model": "b", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2}),
            await c.post("/infill", json={"model": "b", "input_prefix": "a", "input_suffix": "b", "n_predict": 2}),
        ]
        stats = (await c.get("/mock/stats")).json()
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["model"] == "a" and answers[1].json()["model"] == "b"
    assert (stats["models"]["a"]["chat_requests"], stats["models"]["b"]["chat_requests"]) == (1, 2)
